#!/usr/bin/env bash
# MXFP8 grouped copies written as bf16 values by the cast (issue 39): the CUDA tests of the MXFP8
# kernels and the expert stacks (TESTS=0 skips them), bench_moe.py at the Qwen3-like shapes with the
# values cast and, in the same run, without it (the copies' codes dequantized by a pass of their
# own, as before), and the MXFP8 step's top kernels by GPU time (PROFILE=0 skips it). Logs in $OUT.
#   benchmarks/mxfp8_values_device.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if [ "${TESTS:-1}" != 0 ]; then
    RUN_TIMEOUT=200 run mxfp8_kernels python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_kernels.py -k "mxfp8 or hybrid or every_kernel"
    RUN_TIMEOUT=240 run experts_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py tests/test_quantized_stacks.py
fi
SYSTEMS=${SYSTEMS:-"bf16,mxfp8 quantized,mxfp8,mxfp8_fwd_nvfp4_bwd quantized"}
timeout 200 python3 benchmarks/bench_moe.py --shapes qwen3 --systems "$SYSTEMS" --steps 20 2>&1 | tee "$OUT/bench_moe_qwen3.log"
echo "# without the values cast (the copies' codes, then a dequantize pass)"
timeout 200 python3 - "$SYSTEMS" <<'PY' 2>&1 | tee "$OUT/bench_moe_qwen3_before.log"
import runpy, sys
from qtensor.core import kernels
kernels.TABLE.load()
kernels.TABLE.eager.pop("mxfp8.cast_values")
sys.argv = ["bench_moe.py", "--shapes", "qwen3", "--systems", sys.argv[1], "--steps", "20"]
runpy.run_path("benchmarks/bench_moe.py", run_name="__main__")
PY
[ "${PROFILE:-1}" = 0 ] || timeout 120 python3 benchmarks/profile_moe_host.py --system "mxfp8 quantized" --top 10 --kernels 18 2>&1 | grep -v Warning | tee "$OUT/profile_mxfp8.log" | head -45
