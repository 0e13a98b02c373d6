#!/usr/bin/env bash
# NVFP4's grouped casts and bf16 grouped GEMMs on one GPU: their CUDA tests (TESTS=0 skips them; with
# the dense NVFP4 and hybrid kernels, whose helpers they share, and the expert stacks'), the bf16
# GEMM benchmark (bench_grouped_mm.py --bf16, --sweep when SWEEP=1; GEMMS=0 skips it), bench_moe.py
# at the Qwen3-like shapes, the grouped path's kernels by GPU time (PROFILE=1), and for NVFP4 and the
# hybrid the layer without the grouped path (group by group, as before; BEFORE=0 skips it).
# Logs go to $OUT.
#   benchmarks/nvfp4_groups_device.sh
source "$(dirname "$0")/device_env.sh"
carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if [ "${TESTS:-1}" != 0 ]; then
    RUN_TIMEOUT=120 run groups_kernels python3 -m pytest -q -rA -s -m cuda -p no:cacheprovider tests/test_nvfp4_groups.py tests/test_cuda_grouped_mm.py
    grep -E "^PASSED|max error" "$OUT/groups_kernels.log" | awk '/max error/ {if ($NF > worst) worst = $NF} /^PASSED/ {print worst, $2; worst = 0}' | sort -g | tail -4
    RUN_TIMEOUT=240 run experts_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py
    RUN_TIMEOUT=200 run nvfp4_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_kernels.py -k "every_kernel or nvfp4 or hybrid"
fi
[ "${GEMMS:-1}" = 0 ] || timeout 150 python3 benchmarks/bench_grouped_mm.py --bf16 ${SWEEP:+--sweep} 2>&1 | tee "$OUT/bench_grouped_mm_bf16.log"
SYSTEMS=${SYSTEMS:-"bf16,torchao rowwise,float8_rowwise quantized,mxfp8,mxfp8 quantized,nvfp4,nvfp4 quantized,mxfp8_fwd_nvfp4_bwd,mxfp8_fwd_nvfp4_bwd quantized"}
timeout 300 python3 benchmarks/bench_moe.py --shapes qwen3 --systems "$SYSTEMS" 2>&1 | tee "$OUT/bench_moe_qwen3.log"
[ -z "${PROFILE:-}" ] || for system in "nvfp4 quantized" "mxfp8_fwd_nvfp4_bwd quantized"; do
    timeout 120 python3 benchmarks/profile_moe_host.py --system "$system" --top 14 --kernels 16 2>&1 | grep -v Warning | tee -a "$OUT/profile_moe_host.log" | head -60
done
[ "${BEFORE:-1}" = 0 ] || timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/bench_moe_group_by_group.log"
import sys
sys.argv = ["bench_moe.py", "--shapes", "qwen3", "--systems", "bf16,nvfp4 quantized,mxfp8_fwd_nvfp4_bwd quantized", "--steps", "3"]
from qtensor.layers import grouped_linear
grouped_linear._pads_groups = lambda *args: None  # every group cast and multiplied in turn, as before
import runpy
runpy.run_path("benchmarks/bench_moe.py", run_name="__main__")
PY
