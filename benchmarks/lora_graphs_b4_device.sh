#!/usr/bin/env bash
# Issue 41: LoRA at batch 4 with the blocks replayed as CUDA graphs (the host's launch time out of
# the way) and the loss in chunks: bf16 against the Float8 base with both copies and with one.
# Logs in $OUT.
#   benchmarks/lora_graphs_b4_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
timeout 400 python3 benchmarks/bench_lora.py --systems "bf16,float8_current,float8_current one-copy" --compile --cuda-graphs \
    --checkpointing --chunked-loss 8 --batch 4 --steps 8 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_graphs_b4.log"
