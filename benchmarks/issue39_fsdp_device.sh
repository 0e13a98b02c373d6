#!/usr/bin/env bash
# Issue 39 on two GPUs (NCCL): the expert stacks' FSDP2 tests and the Hugging Face FSDP2 tests,
# the stacks' and grouped kernels' CUDA tests on one GPU, with PROFILE=1 the host profile of the
# experts layer on one GPU (profile_moe_host.py), then bench_moe_fsdp.py. Logs go to $OUT.
#   benchmarks/issue39_fsdp_device.sh [bench_moe_fsdp.py arguments]
source "$(dirname "$0")/device_env.sh"
carried transformers  # the transformers the tests are written for
nvidia-smi --query-gpu=name --format=csv,noheader
run experts_fsdp_nccl env QTENSOR_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_experts.py -k "fsdp2 or one_rank"
run hf_fsdp_nccl env QTENSOR_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_hf_fsdp.py
run stacks_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py tests/test_quantized_stacks.py tests/test_cuda_grouped_mm.py
[ -z "${PROFILE:-}" ] || for system in "bf16" "float8_rowwise quantized" "float8_rowwise quantized fast-backward"; do
    timeout 120 python3 benchmarks/profile_moe_host.py --system "$system" --top 18 2>&1 | grep -v Warning | tee -a "$OUT/profile_moe_host.log" | head -32
done
timeout 500 torchrun --nproc_per_node 2 benchmarks/bench_moe_fsdp.py "$@" 2>&1 | grep -v Warning | tee "$OUT/bench_moe_fsdp.log"
