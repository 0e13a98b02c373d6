#!/usr/bin/env bash
# FSDP2 speed (issue 38) on a 2-GPU machine; logs go to $OUT.
#   benchmarks/issue38_device.sh nccl [pytest -k EXPR]   the FSDP2 tests on 2 GPUs with NCCL
#   benchmarks/issue38_device.sh fsdp [bench_fsdp.py arguments]
#                                  torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py, torchao installed
#                                  from the carried wheel in .whl/ when it is there
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/qtensor-device}
mkdir -p "$OUT"
LIMIT=${LIMIT:-540}
mode=$1; shift
case "$mode" in
nccl)
    QTENSOR_TEST_DEVICE=cuda timeout "$LIMIT" python3 -m pytest -q tests/test_fsdp.py -p no:cacheprovider ${1:+-k "$1"} >"$OUT/nccl_tests.log" 2>&1
    echo "nccl rc=$?"
    grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/nccl_tests.log" | tail -12
    ;;
fsdp)
    if ls .whl/torchao-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-deps --target /tmp/tao .whl/torchao-*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/tao
    fi
    timeout "$LIMIT" torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py "$@" 2>&1 | grep -v "UserWarning\|return func\|^W1\|^\*\*\*\|OMP_NUM" | tee "$OUT/bench_fsdp.log"
    ;;
esac
