#!/usr/bin/env bash
# Is a compiled LoRA step at batch 1 bound by the host or by the GPU (issue 41)? profile_lora.py
# with the blocks compiled as CUDA graphs, for bf16 and the one-copy Float8 base: each step's wall
# time, the host's own time and the GPU's (the kernels by GPU time), then the host's profile.
# Logs in $OUT.
#   benchmarks/lora_queue_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
SYSTEMS=${SYSTEMS:-"bf16,float8_current one-copy"}
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
IFS=, read -ra systems <<<"$SYSTEMS"
for system in "${systems[@]}"; do
    name=$(echo "$system" | tr ' ' _)
    timeout 200 python3 benchmarks/profile_lora.py --systems "$system" --compile --cuda-graphs --batch 1 --top 40 \
        >"$OUT/lora_kernels_$name.log" 2>&1
    grep "^== " "$OUT/lora_kernels_$name.log"
    timeout 200 python3 benchmarks/profile_lora.py --systems "$system" --compile --cuda-graphs --batch 1 --host ${TOP:-40} \
        >"$OUT/lora_host_$name.log" 2>&1
    grep "^== " "$OUT/lora_host_$name.log"
done
