#!/usr/bin/env bash
# qtensor's grouped FP8 GEMM kernels on one GPU: their CUDA tests and the expert stacks' CUDA tests,
# the GEMM benchmark (bench_grouped_mm.py, --sweep when SWEEP=1; skipped with GEMMS=0), then
# bench_moe.py with the kernels and without them (the same code with the table entries $WITHOUT
# removed, by default the grouped GEMMs: torch's split-accumulator grouped GEMMs run instead),
# alternating, torchao from the carried wheel in .whl/ when it is there.
#   benchmarks/grouped_mm_device.sh [bench_moe.py arguments]      logs go to $OUT
source "$(dirname "$0")/device_env.sh"
carried torchao
WITHOUT=${WITHOUT:-grouped_mm.float8_rows,grouped_mm.float8_columns}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
RUN_TIMEOUT=240 run grouped_cuda python3 -m pytest -q -s -m cuda -p no:cacheprovider tests/test_cuda_grouped_mm.py tests/test_experts.py tests/test_cuda_kernels.py -k "grouped or experts or every_kernel"
echo "largest error / bound of the kernel tests: $(grep -o 'max error / bound: [0-9.e+-]*' "$OUT/grouped_cuda.log" | awk '{print $NF}' | sort -g | tail -1)"
[ "${GEMMS:-1}" = 0 ] || timeout 200 python3 benchmarks/bench_grouped_mm.py ${SWEEP:+--sweep} 2>&1 | tee "$OUT/bench_grouped_mm.log"
cat >"$OUT/without_kernels.py" <<'PY'
import runpy, sys
from qtensor.core import kernels
kernels.registered()
for name in sys.argv.pop(1).split(","):
    kernels.TABLE.eager.pop(name)
sys.argv = ["benchmarks/bench_moe.py", *sys.argv[1:]]
runpy.run_path("benchmarks/bench_moe.py", run_name="__main__")
PY
for round in 1 2; do
    echo "== without $WITHOUT (round $round)"
    timeout 200 python3 "$OUT/without_kernels.py" "$WITHOUT" "$@" 2>&1 | tee -a "$OUT/bench_moe_before_after.log"
    echo "== with them (round $round)"
    timeout 200 python3 benchmarks/bench_moe.py "$@" 2>&1 | tee -a "$OUT/bench_moe_before_after.log"
done
[ -z "${PROFILE:-}" ] || for system in "float8_rowwise quantized" "float8_rowwise quantized fast-backward"; do
    timeout 120 python3 benchmarks/profile_moe_host.py --system "$system" --top 12 2>&1 | grep -v Warning | tee -a "$OUT/profile_moe_host.log" | head -24
done
