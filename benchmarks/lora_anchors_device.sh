#!/usr/bin/env bash
# Issue 41, on one H100: LoRA at batch 1, blocks as CUDA graphs, loss in chunks, over bf16, the
# one-copy Float8 and weight-only NVFP4 bases, torchao's NF4 and bitsandbytes' NF4 (the wheels
# carried in .whl/); then bf16 and the one-copy Float8 base again with the compiled blocks' guards
# skipped in the timed steps (the host's share of a batch-1 step). Logs in $OUT.
# The four wheels pass the carry's 64 MiB with bitsandbytes' whole (42 MiB: a library for every CUDA
# and ROCm release); the run used one without the libraries of CUDA before 12.8 and of ROCm and XPU
# (14 MiB; the GPU's torch is built for CUDA 13.0), their lines dropped from its RECORD.
#   benchmarks/lora_anchors_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao; carried bitsandbytes
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
common=(--compile --cuda-graphs --checkpointing --chunked-loss 8 --batch 1 --steps 10)
timeout 330 python3 benchmarks/bench_lora.py --systems "bf16,float8_current one-copy,nvfp4 weight-only one-copy,nf4,bnb_nf4" "${common[@]}" 2>&1 \
    | grep -v -i warn | tee "$OUT/bench_lora_anchors_b1.log"
timeout 200 python3 benchmarks/bench_lora.py --systems "bf16,float8_current one-copy" "${common[@]}" --skip-guards 2>&1 \
    | grep -v -i warn | tee "$OUT/bench_lora_skip_guards_b1.log"
