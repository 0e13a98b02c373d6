#!/usr/bin/env bash
# A held weight's flatten kept between compiled calls and its inner tensors read as properties
# (issue 41): the compile and LoRA CUDA tests (TESTS=0 skips them), then bench_lora.py at batch 1
# with checkpointing, blocks compiled as CUDA graphs, each system's compiled blocks freed before the
# next; the Float8 base again as before (the flatten computed at every call, the inner tensors read
# through __getattr__ behind torch.compiler.disable's wrapper; BEFORE=0 skips it); then compiled
# without CUDA graphs (PLAIN=0 skips it). Logs in $OUT.
#   benchmarks/lora_flatten_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if [ "${TESTS:-1}" != 0 ]; then
    RUN_TIMEOUT=150 run compile_tests python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_compile.py tests/test_lora.py
fi
SYSTEMS=${SYSTEMS:-"bf16,float8_current one-copy,nvfp4 weight-only one-copy,nf4"}
timeout 280 python3 benchmarks/bench_lora.py --systems "$SYSTEMS" --compile --cuda-graphs --checkpointing --batch 1 --steps 10 2>&1 \
    | grep -v -i warn | tee "$OUT/bench_lora_graphs.log"
[ "${BEFORE:-1}" = 0 ] || timeout 120 python3 - <<'PY' 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_graphs_before.log"
import runpy, sys
import torch
from qtensor.core.tensor import QuantizedTensor
from qtensor.layers import weight
print("# as before: the flatten computed at every call, inner tensors through __getattr__ behind the disable wrapper")
QuantizedTensor._flatten_held = weight.QuantizedWeight._flatten_held = lambda self: None
QuantizedTensor.__getattr__ = torch.compiler.disable(QuantizedTensor.__getattr__, recursive=False)
weight.LayerWeight.__getattr__ = torch.compiler.disable(weight.LayerWeight.__getattr__)
weight.QuantizedWeight.__getattr__ = torch.compiler.disable(weight.QuantizedWeight.__getattr__)
sys.argv = ["bench_lora.py", "--systems", "float8_current one-copy", "--compile", "--cuda-graphs", "--checkpointing", "--batch", "1", "--steps", "10"]
runpy.run_path("benchmarks/bench_lora.py", run_name="__main__")
PY
[ "${PLAIN:-1}" = 0 ] || timeout 150 python3 benchmarks/bench_lora.py --systems "bf16,float8_current one-copy" --compile --checkpointing --batch 1 --steps 10 2>&1 \
    | grep -v -i warn | tee "$OUT/bench_lora_compiled.log"
