# Sourced by the issue-39 device scripts: strict mode, the checkout as the working directory and on
# PYTHONPATH, logs under $OUT, and helpers.
#   carried torchao|transformers   the wheel carried in .whl/, where it is there, put on PYTHONPATH
#   run NAME COMMAND...            COMMAND's output into $OUT/NAME.log; its status, last line and failures printed
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/qtensor-device}
mkdir -p "$OUT"

carried() {
    local wheels=(.whl/"$1"-*.whl)
    [ -e "${wheels[0]}" ] || return 0
    python3 -m pip install -q --no-index --no-deps --target "/tmp/carried-$1" "${wheels[@]}" >/dev/null 2>&1 \
        && export PYTHONPATH=/tmp/carried-$1:$PYTHONPATH
}

run() {
    local name=$1; shift
    timeout "${RUN_TIMEOUT:-400}" "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$?: $(tail -1 "$OUT/$name.log")"
    grep -E "^(FAILED|ERROR)|Error:" "$OUT/$name.log" | head -10
}
