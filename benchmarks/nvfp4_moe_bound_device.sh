#!/usr/bin/env bash
# Issue 39 on one GPU: the expert stacks' CUDA tests, then the Qwen3-like experts layer for bf16 and
# the held stacks of every recipe that misses or nears its target there, eager and with the layer
# through torch.compile, in one run. Logs in $OUT.
#   benchmarks/nvfp4_moe_bound_device.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
RUN_TIMEOUT=150 run experts_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py
systems="bf16,nvfp4 quantized,mxfp8_fwd_nvfp4_bwd quantized,mxfp8 quantized,float8_rowwise quantized"
timeout 120 python3 benchmarks/bench_moe.py --shapes qwen3 --systems "$systems" 2>&1 | grep -v -i warn | tee "$OUT/bench_moe_eager.log"
timeout 240 python3 benchmarks/bench_moe.py --shapes qwen3 --systems "$systems" --compile 2>&1 | grep -v -i warn | tee "$OUT/bench_moe_compiled.log"
