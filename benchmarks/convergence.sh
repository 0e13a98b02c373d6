#!/usr/bin/env bash
# The convergence study on a GPU machine, in the background, so that it can outlast one command:
#
#   benchmarks/convergence.sh start [qtensor.study options]   start it (returns at once)
#   benchmarks/convergence.sh wait SECONDS                     wait for it, at most SECONDS; print its
#                                                              progress; pack the results into $OUT
#
# If .corpus/lib.tar.xz exists (made by you: a tar.xz whose top folder lib/ holds a standard
# library's .py files, for a GPU machine whose Python ships fewer of them), the study reads it
# (--corpus) instead of this interpreter's standard library: see docs/convergence.md.
set -euo pipefail
DIR=${STUDY_DIR:-/tmp/study}
case "${1:-}" in
start)
    shift
    corpus=()
    if [ -f .corpus/lib.tar.xz ]; then
        mkdir -p /tmp/corpus && tar xJf .corpus/lib.tar.xz -C /tmp/corpus
        corpus=(--corpus /tmp/corpus/lib)
    fi
    mkdir -p "$DIR"
    # With SPEED_RUNS set (e.g. "all"), those runs are then timed alone once the training is over.
    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
    setsid nohup bash -c 'python3 -m qtensor.study "$@" && if [ -n "${SPEED_RUNS:-}" ]; then
            python3 -m qtensor.study "$@" --runs "$SPEED_RUNS" --speed-only --speed-steps 20; fi' \
        study --out "$DIR" "${corpus[@]}" "$@" >"$DIR/study.log" 2>&1 </dev/null &
    echo $! >"$DIR/pid"
    echo "started: pid $(cat "$DIR/pid"), log $DIR/study.log"
    ;;
wait)
    end=$((SECONDS + ${2:?seconds}))
    while [ $SECONDS -lt "$end" ] && kill -0 "$(cat "$DIR/pid")" 2>/dev/null; do sleep 5; done
    kill -0 "$(cat "$DIR/pid")" 2>/dev/null && echo "still running" || echo "finished"
    # The newest progress line of each run, then the end of the log.
    grep " step " "$DIR/study.log" | awk '{latest[$1] = $0} END {for (run in latest) print latest[run]}' | sort
    tail -n 25 "$DIR/study.log"
    if [ -n "${OUT:-}" ]; then tar czf "$OUT/study.tgz" -C "$(dirname "$DIR")" "$(basename "$DIR")"; fi
    ;;
*)
    echo "usage: $0 start [study options] | wait SECONDS" >&2
    exit 2
    ;;
esac
