#!/usr/bin/env bash
# Issue 41: LoRA over each base with the loss computed in chunks (bench_lora.py --chunked-loss 8),
# so that the step's peak is the model's and not the [tokens, vocabulary] logits': at batch 1 with
# the blocks as CUDA graphs (bf16, one-copy Float8, one-copy weight-only NVFP4, torchao NF4), and
# at batch 4 with the blocks compiled (bf16, one-copy Float8). Logs in $OUT.
#   benchmarks/lora_memory_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
timeout 300 python3 benchmarks/bench_lora.py --systems "bf16,float8_current one-copy,nvfp4 weight-only one-copy,nf4" --compile --cuda-graphs \
    --checkpointing --chunked-loss 8 --batch 1 --steps 10 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_chunked_b1.log"
timeout 200 python3 benchmarks/bench_lora.py --systems "bf16,float8_current one-copy" --compile --checkpointing --chunked-loss 8 \
    --batch 4 --steps 10 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_chunked_b4.log"
