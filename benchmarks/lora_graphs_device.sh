#!/usr/bin/env bash
# Why CUDA graphs leave a compiled LoRA step over a Float8 base slower than bf16's at batch 1
# (issue 41): bench_lora.py --cuda-graphs with inductor's performance hints logged (a graph that
# cudagraph trees skip says why), the GPU kernels of a compiled step by count, and the generated
# code of the Float8 block's graphs. Logs in $OUT.
#   benchmarks/lora_graphs_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
SYSTEMS=${SYSTEMS:-"bf16,float8_current one-copy"}
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
TORCH_LOGS=perf_hints timeout 250 python3 benchmarks/bench_lora.py --systems "$SYSTEMS" --compile --cuda-graphs --checkpointing \
    --batch 1 --steps 6 >"$OUT/lora_graphs.log" 2>&1
grep -iE "skipping|cudagraph|tokens/s|^bf16|^float8|failed" "$OUT/lora_graphs.log" | sort | uniq -c | head -20
timeout 250 python3 benchmarks/profile_lora.py --systems "$SYSTEMS" --compile --batch 1 --top 70 >"$OUT/lora_kernels.log" 2>&1
grep "^== " "$OUT/lora_kernels.log"
mkdir -p "$OUT/code"
grep -l "def call" -r /tmp/inductor-lora --include=*.py | while read -r f; do cp "$f" "$OUT/code/$(wc -l <"$f")_$(basename "$f")"; done
ls "$OUT/code" | head -30
