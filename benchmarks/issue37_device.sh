#!/usr/bin/env bash
# The layout-by-layer change on a 2-GPU machine: `tests` runs the CUDA tests and the NCCL tests
# (FSDP2, tensor parallelism); `bench` runs before_after.sh against BASE (an export of the commit
# before the change) and profile_host.py over both trees. Logs go to $OUT.
#   benchmarks/issue37_device.sh tests|bench BASE
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/qtensor-device}
mkdir -p "$OUT"
case "$1" in
tests)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    PYTHONPATH=$PWD timeout 330 python3 -m pytest -q -m cuda tests -p no:cacheprovider >"$OUT/cuda_tests.log" 2>&1
    tail -3 "$OUT/cuda_tests.log"
    PYTHONPATH=$PWD QTENSOR_TEST_DEVICE=cuda timeout 230 python3 -m pytest -q tests/test_fsdp.py tests/test_tensor_parallel.py -p no:cacheprovider >"$OUT/nccl_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/nccl_tests.log" | tail -12
    ;;
bench)
    BASE=$2
    benchmarks/before_after.sh "$BASE" 2 -- --shapes 2 --blocks 4 --steps 20 >"$OUT/before_after.log" 2>&1
    for tree in "$BASE" "$PWD"; do
        for recipe in float8_current mxfp8; do
            echo "== $tree $recipe"
            (cd benchmarks && PYTHONPATH=$tree:$PWD/benchmarks python3 profile_host.py --recipe $recipe --shape 1024,1024,1024 --top 0 --kernels 0 2>&1 | head -1)
        done
    done | tee "$OUT/profile_host.log"
    ;;
esac
