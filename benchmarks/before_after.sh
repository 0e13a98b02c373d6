#!/usr/bin/env bash
# The same benchmark over two checkouts on one GPU, back to back: BASE (an export of the commit
# before a change, e.g. `git archive OLD qtensor qtensor_kernels benchmarks | tar -x -C base`) and
# this checkout, ROUNDS times in alternation so that both see the same machine. This checkout's
# bench_linear.py runs both times (it uses qtensor's public API only); PYTHONPATH picks the qtensor.
#   benchmarks/before_after.sh BASE [ROUNDS] -- [bench_linear.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=$(cd "${1:?usage: before_after.sh BASE [ROUNDS] -- [bench_linear.py options]}" && pwd); shift
ROUNDS=1
if [ "${1:-}" != "--" ] && [ -n "${1:-}" ]; then ROUNDS=$1; shift; fi
[ "${1:-}" = "--" ] && shift
export PYTHONUNBUFFERED=1
for round in $(seq "$ROUNDS"); do
    for tree in "$BASE" "$PWD"; do
        label=$([ "$tree" = "$BASE" ] && echo before || echo after)
        echo "=== $label (round $round): $tree"
        PYTHONPATH=$tree python3 "$PWD/benchmarks/bench_linear.py" "$@"
    done
done
