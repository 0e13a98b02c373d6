#!/usr/bin/env bash
# NVFP4's dequantize and the GEMM epilogue without a bias traced by torch.compile (issue 41): their
# CUDA tests (TESTS=0 skips them), then bench_lora.py with every block compiled, batch 1,
# checkpointing, for bf16, the NVFP4 weight-only base and torchao's NF4, traced and, in the same
# run, with both as custom ops (as before: BEFORE=0 skips that). Logs in $OUT.
#   benchmarks/nvfp4_traced_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if [ "${TESTS:-1}" != 0 ]; then
    RUN_TIMEOUT=300 run traced_tests python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_kernels.py tests/test_compile.py \
        -k "nvfp4_dequantize or epilogue or grouped_copies_as_values or (fusable and nvfp4)"
fi
SYSTEMS=${SYSTEMS:-"bf16,nvfp4 weight-only one-copy,nf4"}
timeout 400 python3 benchmarks/bench_lora.py --systems "$SYSTEMS" --compile --checkpointing --batch 1 --steps 10 2>&1 \
    | grep -v -i warn | tee "$OUT/bench_lora_compiled.log"
[ "${BEFORE:-1}" = 0 ] || timeout 300 python3 - "$SYSTEMS" <<'PY' 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_compiled_before.log"
import runpy, sys
from qtensor.core import kernels
kernels.TRACED = kernels.TRACED - {"nvfp4.dequantize", "gemm.scale_output"}  # custom ops again, as before
print("# NVFP4's dequantize and the GEMM epilogue as custom ops")
sys.argv = ["bench_lora.py", "--systems", sys.argv[1].split(",", 1)[1], "--compile", "--checkpointing", "--batch", "1", "--steps", "10"]
runpy.run_path("benchmarks/bench_lora.py", run_name="__main__")
PY
