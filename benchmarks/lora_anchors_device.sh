#!/usr/bin/env bash
# Issue 41: the NF4 anchors beside the NVFP4 bases: LoRA at batch 1, blocks as CUDA graphs, loss in
# chunks, over bf16, the one-copy weight-only NVFP4 base, torchao's NF4 and bitsandbytes' NF4
# (both wheels carried in .whl/). Logs in $OUT.
#   benchmarks/lora_anchors_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao; carried bitsandbytes
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
timeout 300 python3 benchmarks/bench_lora.py --systems "bf16,nvfp4 weight-only one-copy,nf4,bnb_nf4" --compile --cuda-graphs \
    --checkpointing --chunked-loss 8 --batch 1 --steps 10 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_anchors_b1.log"
timeout 250 python3 benchmarks/bench_lora.py --systems "bf16,bnb_nf4" --checkpointing --chunked-loss 8 --batch 1 --steps 10 2>&1 \
    | grep -v -i warn | tee "$OUT/bench_lora_anchors_eager_b1.log"
