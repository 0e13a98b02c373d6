#!/usr/bin/env bash
# One call on a GPU machine: the whole test suite (CUDA tests included), the demo, the benchmark.
# Uses the machine's own torch; qtensor runs from the checkout (no install needed).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/qtensor-device}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -5
python3 -m qtensor.demo 2>"$OUT/demo.progress" | tee "$OUT/demo.log"
python3 benchmarks/bench_quantize.py 2>&1 | tee "$OUT/bench.log"
