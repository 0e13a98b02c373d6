#!/usr/bin/env bash
# Issue 39 on one GPU: the expert stacks' CUDA tests, then bench_moe.py (torchao from the carried
# wheel in .whl/ when it is there). Logs go to $OUT.
#   benchmarks/issue39_device.sh [bench_moe.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/qtensor-device}
mkdir -p "$OUT"
if ls .whl/torchao-*.whl >/dev/null 2>&1; then
    pip install -q --no-deps --target /tmp/tao .whl/torchao-*.whl >/dev/null 2>&1 && export PYTHONPATH=$PWD:/tmp/tao
fi
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py tests/test_cuda_kernels.py -k "experts or grouped or every_kernel" >"$OUT/experts_cuda.log" 2>&1
echo "experts cuda tests rc=$?: $(tail -1 "$OUT/experts_cuda.log")"
grep -E "^(FAILED|ERROR)|Error:|error/bound" "$OUT/experts_cuda.log" | head -20
timeout 420 python3 benchmarks/bench_moe.py "$@" 2>&1 | tee "$OUT/bench_moe.log"
