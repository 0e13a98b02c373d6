#!/usr/bin/env bash
# One compiled LoRA step at batch 1, blocks as CUDA graphs, as a host and GPU timeline (issue 41):
# profile_lora.py --trace for bf16 and the one-copy Float8 base; the traces gzipped in $OUT/traces.
#   benchmarks/lora_trace_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
SYSTEMS=${SYSTEMS:-"bf16,float8_current one-copy"}
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
timeout 400 python3 benchmarks/profile_lora.py --systems "$SYSTEMS" --compile --cuda-graphs --batch 1 --top 25 --trace "$OUT/traces" \
    >"$OUT/lora_trace.log" 2>&1
grep "^== " "$OUT/lora_trace.log"
gzip "$OUT"/traces/*.json
ls -la "$OUT/traces"
