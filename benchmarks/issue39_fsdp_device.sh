#!/usr/bin/env bash
# Issue 39 on two GPUs (NCCL): the expert stacks' FSDP2 tests and the Hugging Face FSDP2 tests,
# the stacks' CUDA tests on one GPU, then bench_moe_fsdp.py. Logs go to $OUT.
#   benchmarks/issue39_fsdp_device.sh [bench_moe_fsdp.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/qtensor-device}
mkdir -p "$OUT"
if ls .whl/transformers-*.whl >/dev/null 2>&1; then  # the transformers the tests are written for
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/transformers-*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # name, command...
    local name=$1; shift
    timeout 400 "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$?: $(tail -1 "$OUT/$name.log")"
    grep -E "^(FAILED|ERROR)|Error:" "$OUT/$name.log" | head -10
}
run experts_fsdp_nccl env QTENSOR_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_experts.py -k "fsdp2 or one_rank"
run hf_fsdp_nccl env QTENSOR_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_hf_fsdp.py
run stacks_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py tests/test_quantized_stacks.py tests/test_cuda_grouped_mm.py
timeout 500 torchrun --nproc_per_node 2 benchmarks/bench_moe_fsdp.py "$@" 2>&1 | grep -v Warning | tee "$OUT/bench_moe_fsdp.log"
