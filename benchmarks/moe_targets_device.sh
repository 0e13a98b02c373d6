#!/usr/bin/env bash
# Issue 39's targets in one run on one GPU: both shapes, bf16, torchao's FP8 row-wise (the carried
# wheel) and the held stacks of each recipe the targets name, eager; then bf16 and the Float8 held
# stacks with each step captured in a CUDA graph. Logs in $OUT.
#   benchmarks/moe_targets_device.sh
# (Its first run on an H100 took 363 s and its time limits stopped both parts in the Qwen3-like rows:
# give each part its own call, or --shapes one at a time.)
source "$(dirname "$0")/device_env.sh"
carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
systems="bf16,torchao rowwise,float8_rowwise quantized,float8_rowwise quantized fast-backward,mxfp8 quantized,nvfp4 quantized,mxfp8_fwd_nvfp4_bwd quantized"
timeout 240 python3 benchmarks/bench_moe.py --systems "$systems" 2>&1 | grep -v -i warn | tee "$OUT/bench_moe_eager.log"
timeout 120 python3 benchmarks/bench_moe.py --systems "bf16,torchao rowwise,float8_rowwise quantized,float8_rowwise quantized fast-backward" --cuda-graphs 2>&1 \
    | grep -v -i warn | tee "$OUT/bench_moe_graphs.log"
