#!/usr/bin/env bash
# Checks on a 2-GPU machine (issues 37 and 38); logs go to $OUT.
#   benchmarks/issue37_device.sh cuda        the CUDA tests (`pytest -m cuda tests`) in four shards, two per GPU
#   benchmarks/issue37_device.sh nccl [EXPR] the NCCL tests: FSDP2 and tensor parallelism on 2 GPUs (pytest -k EXPR)
#   benchmarks/issue37_device.sh fsdp [bench_fsdp.py arguments]
#                                            torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py, torchao
#                                            installed from the carried wheel in .whl/ when it is there
#   benchmarks/issue37_device.sh bench BASE  before_after.sh against BASE (an export of the commit before
#                                            the change): one layer, then the block stack; profile_host.py over both
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/qtensor-device}
mkdir -p "$OUT"
LIMIT=${LIMIT:-540}
mode=$1; shift
case "$mode" in
cuda)
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1
    bulk="nvfp4_cast_kernel_is_bitwise or mxfp8_cast_kernel_is_bitwise or float8_cast_kernel_is_bitwise"
    run() {  # run GPU LOG pytest-arguments...
        local gpu=$1 log=$2; shift 2
        CUDA_VISIBLE_DEVICES=$gpu timeout "$LIMIT" python3 -m pytest -q -m cuda -p no:cacheprovider "$@" >"$OUT/$log" 2>&1
        echo "$log rc=$?: $(tail -1 "$OUT/$log")"
    }
    run 0 cuda_other_files.log tests/test_compile.py tests/test_activation_memory.py tests/test_cuda.py &
    run 0 cuda_kernels_nvfp4.log tests/test_cuda_kernels.py -k "nvfp4_cast_kernel_is_bitwise" &
    run 1 cuda_kernels_fp8.log tests/test_cuda_kernels.py -k "mxfp8_cast_kernel_is_bitwise or float8_cast_kernel_is_bitwise" &
    run 1 cuda_kernels_rest.log tests/test_cuda_kernels.py -k "not ($bulk)" &
    wait
    grep -hE "^(FAILED|ERROR)" "$OUT"/cuda_*.log | head -20
    ;;
nccl)
    QTENSOR_TEST_DEVICE=cuda timeout "$LIMIT" python3 -m pytest -q tests/test_fsdp.py tests/test_tensor_parallel.py \
        -p no:cacheprovider ${1:+-k "$1"} >"$OUT/nccl_tests.log" 2>&1
    echo "nccl rc=$?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/nccl_tests.log" | tail -12
    ;;
fsdp)
    if ls .whl/torchao-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-deps --target /tmp/tao .whl/torchao-*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/tao
    fi
    timeout "$LIMIT" torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py "$@" 2>&1 \
        | grep -v "UserWarning\|return func\|^W1\|^\*\*\*\|OMP_NUM" | tee "$OUT/bench_fsdp.log"
    ;;
bench)
    BASE=$(cd "$1" && pwd)
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1
    timeout 200 benchmarks/before_after.sh "$BASE" 1 -- --shapes 2 --skip-stack >"$OUT/before_after_layer.log" 2>&1
    timeout 260 benchmarks/before_after.sh "$BASE" 2 -- --skip-linear --blocks 4 --steps 20 >"$OUT/before_after_stack.log" 2>&1
    grep -E "^===|^(bf16|float8_current|float8_delayed|float8_rowwise|float8_blockwise|mxfp8|nvfp4|mxfp8_fwd_nvfp4_bwd) +[0-9]" "$OUT"/before_after_*.log
    for tree in "$BASE" "$PWD"; do
        for recipe in float8_current mxfp8; do
            echo "$tree $recipe $( (cd benchmarks && PYTHONPATH=$tree:$PWD/benchmarks timeout 40 python3 profile_host.py --recipe $recipe --shape 1024,1024,1024 --top 0 --kernels 0 2>&1 | grep 'ms/step') )"
        done
    done | tee "$OUT/profile_host.log"
    ;;
esac
