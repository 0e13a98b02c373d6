#!/usr/bin/env bash
# Issue 41: a compiled LoRA step at batch 1 (blocks as CUDA graphs) over the one-copy Float8 base,
# with the quantized weights answering compiled code's metadata reads and hasattr probes at once
# ("after") and as before ("before": each read through the layer's routing, each probe through the
# inner-tensor lookup), two rounds, then bf16. Logs in $OUT.
#   benchmarks/lora_probes_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
# Fresh processes, alternating, one system each: the host's speed drifts within a run.
fp8() {  # $1: "before" or "after"
    timeout 200 python3 - "$1" <<'PY' 2>&1 | grep -v -i warn | tail -1
import runpy, sys
if sys.argv[1] == "before":
    from qtensor.core import flatten, tensor
    from qtensor.layers import traced_state, weight
    tensor.METADATA_READS = weight.METADATA_READS = frozenset()
    def quantized_tensor_getattr(self, name):
        return flatten.inner_tensor(self, name)
    def layer_weight_getattr(self, name):
        if traced_state.is_state_name(name):
            return traced_state.inner_tensor(self, name)
        return self._data_attribute(name)
    def quantized_weight_getattr(self, name):
        if name.startswith("cast__") and self.gathered_cast is not None:
            return self.gathered_cast.notes[int(name.removeprefix("cast__"))][1]
        return layer_weight_getattr(self, name)
    for cls, fn in ((tensor.QuantizedTensor, quantized_tensor_getattr), (weight.LayerWeight, layer_weight_getattr), (weight.QuantizedWeight, quantized_weight_getattr)):
        cls.__getattr__ = tensor.skipped_by_compiler(fn)
sys.argv = ["bench_lora.py", "--systems", "float8_current one-copy", "--compile", "--cuda-graphs", "--checkpointing", "--batch", "1", "--steps", "20"]
runpy.run_path("benchmarks/bench_lora.py", run_name="__main__")
PY
}
{
    for round in 1 2; do
        for variant in before after; do echo "$variant: $(fp8 $variant)"; done
    done
    echo "bf16: $(timeout 200 python3 benchmarks/bench_lora.py --systems bf16 --compile --cuda-graphs --checkpointing --batch 1 --steps 20 2>&1 | tail -1)"
} | tee "$OUT/bench_lora_probes_ab.log"
