#!/usr/bin/env bash
# Issue 39 on one GPU: the expert stacks' CUDA tests, then bench_moe.py (torchao from the carried
# wheel in .whl/ when it is there). Logs go to $OUT.
#   benchmarks/issue39_device.sh [bench_moe.py arguments]
source "$(dirname "$0")/device_env.sh"
carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
run experts_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py tests/test_cuda_kernels.py -k "experts or grouped or every_kernel"
timeout 420 python3 benchmarks/bench_moe.py "$@" 2>&1 | tee "$OUT/bench_moe.log"
