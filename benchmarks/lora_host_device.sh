#!/usr/bin/env bash
# Where a compiled LoRA step at batch 1 spends its host time (issue 41). bench_lora.py with the
# blocks compiled as CUDA graphs for bf16 and the one-copy Float8 base, then the Float8 base again
# with the quantized tensors' __getattr__ behind torch.compiler.disable's wrapper (as before:
# BEFORE=0 skips it), then profile_lora.py --host of each (GRAPHS=0: compiled without CUDA graphs).
# Logs in $OUT.
#   benchmarks/lora_host_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
SYSTEMS=${SYSTEMS:-"bf16,float8_current one-copy"}
graphs=$([ "${GRAPHS:-1}" = 0 ] || echo --cuda-graphs)
timeout 250 python3 benchmarks/bench_lora.py --systems "$SYSTEMS" --compile $graphs --checkpointing --batch 1 --steps 10 2>&1 \
    | grep -v -i warn | tee "$OUT/bench_lora.log"
[ "${BEFORE:-1}" = 0 ] || timeout 200 python3 - "$SYSTEMS" $graphs <<'PY' 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_before.log"
import runpy, sys
import torch
from qtensor.core.tensor import QuantizedTensor
from qtensor.layers import weight
print("# the quantized tensors' __getattr__ behind torch.compiler.disable's wrapper")
QuantizedTensor.__getattr__ = torch.compiler.disable(QuantizedTensor.__getattr__, recursive=False)
weight.LayerWeight.__getattr__ = torch.compiler.disable(weight.LayerWeight.__getattr__)
weight.QuantizedWeight.__getattr__ = torch.compiler.disable(weight.QuantizedWeight.__getattr__)
sys.argv = ["bench_lora.py", "--systems", sys.argv[1].split(",", 1)[1], "--compile", *sys.argv[2:], "--checkpointing", "--batch", "1", "--steps", "10"]
runpy.run_path("benchmarks/bench_lora.py", run_name="__main__")
PY
IFS=, read -ra systems <<<"$SYSTEMS"
for system in "${systems[@]}"; do
    name=$(echo "$system" | tr ' ' _)
    timeout 200 python3 benchmarks/profile_lora.py --systems "$system" --compile $graphs --batch 1 --host ${TOP:-40} \
        >"$OUT/lora_host_$name.log" 2>&1
    grep "^== " "$OUT/lora_host_$name.log"
done
