#!/usr/bin/env bash
# Issue 39 on a two-GPU host in one call: issue39_fsdp_device.sh's tests (NCCL FSDP2 of stacks,
# Hugging Face FSDP2, the stacks' and grouped kernels' CUDA tests), the host profile of the experts
# layer on one GPU, then bench_moe_fsdp.py. Logs go to $OUT.
#   benchmarks/issue39_x2_device.sh [bench_moe_fsdp.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/qtensor-device}
mkdir -p "$OUT"
if ls .whl/transformers-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/transformers-*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # name, command...
    local name=$1; shift
    timeout 300 "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$?: $(tail -1 "$OUT/$name.log")"
    grep -E "^(FAILED|ERROR)|Error:" "$OUT/$name.log" | head -10
}
run experts_fsdp_nccl env QTENSOR_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_experts.py -k "fsdp2 or one_rank"
run hf_fsdp_nccl env QTENSOR_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_hf_fsdp.py
run stacks_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py tests/test_quantized_stacks.py tests/test_cuda_grouped_mm.py
for system in "bf16" "float8_rowwise quantized" "float8_rowwise quantized fast-backward"; do
    timeout 120 python3 benchmarks/profile_moe_host.py --system "$system" --top 18 2>&1 | grep -v Warning | tee -a "$OUT/profile_moe_host.log" | head -32
done
timeout 240 torchrun --nproc_per_node 2 benchmarks/bench_moe_fsdp.py "$@" 2>&1 | grep -v Warning | tee "$OUT/bench_moe_fsdp.log"
