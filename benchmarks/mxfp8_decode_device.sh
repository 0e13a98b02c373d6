#!/usr/bin/env bash
# The grouped bf16 kernels reading MXFP8 codes (decoded as they load) on one GPU: their CUDA tests
# and the expert stacks' (TESTS=0 skips them), bench_grouped_mm.py --mxfp8 (--sweep with SWEEP=1;
# GEMMS=0 skips it), bench_moe.py at the Qwen3-like shapes, and the same
# MXFP8 systems with the decoding patched off (dequantized copies and torch's grouped GEMM, as
# before; BEFORE=0 skips it). LORA=1 adds benchmarks/bench_lora.py at the 1.1B shape and the LoRA
# CUDA tests. Logs go to $OUT.
#   benchmarks/mxfp8_decode_device.sh
source "$(dirname "$0")/device_env.sh"
carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if [ "${TESTS:-1}" != 0 ]; then
    RUN_TIMEOUT=150 run grouped_kernels python3 -m pytest -q -rA -s -m cuda -p no:cacheprovider tests/test_cuda_grouped_mm.py
    grep -E "max error" "$OUT/grouped_kernels.log" | sort -k5 -g | tail -2
fi
[ "${GEMMS:-1}" = 0 ] || timeout 150 python3 benchmarks/bench_grouped_mm.py --mxfp8 ${SWEEP:+--sweep} 2>&1 | tee "$OUT/bench_grouped_mm_mxfp8.log"
SYSTEMS=${SYSTEMS:-"bf16,float8_rowwise quantized,mxfp8,mxfp8 quantized,mxfp8_fwd_nvfp4_bwd quantized,nvfp4 quantized"}
timeout 240 python3 benchmarks/bench_moe.py --shapes qwen3 --systems "$SYSTEMS" 2>&1 | tee "$OUT/bench_moe_qwen3.log"
[ "${BEFORE:-1}" = 0 ] || timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/bench_moe_no_decoding.log"
import sys
sys.argv = ["bench_moe.py", "--shapes", "qwen3", "--systems", "bf16,mxfp8 quantized,mxfp8_fwd_nvfp4_bwd quantized", "--steps", "5"]
from qtensor.gemm import grouped
grouped._decodes = lambda *args: None  # the copies dequantized, then torch's grouped GEMM, as before
import runpy
runpy.run_path("benchmarks/bench_moe.py", run_name="__main__")
PY
if [ "${TESTS:-1}" != 0 ]; then
    RUN_TIMEOUT=240 run experts_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py tests/test_quantized_stacks.py
fi
if [ "${LORA:-0}" != 0 ]; then  # (LORA=1 TESTS=0 GEMMS=0 SYSTEMS=bf16 BEFORE=0: the LoRA part alone)
    carried transformers; carried peft
    timeout 300 python3 benchmarks/bench_lora.py 2>&1 | tee "$OUT/bench_lora_1b.log"
    RUN_TIMEOUT=200 run lora_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_lora.py
fi
