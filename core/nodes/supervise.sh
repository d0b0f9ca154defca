#!/bin/sh
# Supervises one ggml-rpc-server on its node: restarts it with backoff when it exits, and records every
# start and exit as a JSON line in events.jsonl. Plain POSIX sh, so a node needs no Python.
# usage: supervise.sh DIR MAX_EXITS WINDOW_S MAX_BACKOFF_S COMMAND [ARG...]
#   MAX_EXITS exits within WINDOW_S seconds is a crash loop: the supervisor records "failed" and stops.
#   Restarts wait 1 s, then twice as long each time, up to MAX_BACKOFF_S; after a run of 10 s, 1 s again.
# Installed with pids.sh before it (`record`: a pid file's "PID START" line, written whole by a rename).
set -u
dir=$1 max_exits=$2 window=$3 max_backoff=$4
shift 4
cd "$dir" || exit 1
record $$ > supervisor.pid.new && mv supervisor.pid.new supervisor.pid

child=
sleeper=
stopping=0
backoff=1
exits=

emit() {
    printf '{"time":%s,"kind":"%s"%s}\n' "$(date +%s)" "$1" "${2:-}" >> events.jsonl
}

on_stop() {
    stopping=1
    if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null; fi
    if [ -n "$sleeper" ]; then kill "$sleeper" 2>/dev/null; fi
}
trap on_stop TERM INT HUP
# Ignored here, ignored in the worker (exec keeps it): a coordinator that dies while a worker writes its answer
# (a watchdog kill, a crash) must cost the worker an EPIPE on that connection, not its life.
trap '' PIPE

finish() {
    emit "$1" "${2:-}"
    rm -f worker.pid supervisor.pid
    exit 0
}

while :; do
    offset=$(wc -c < worker.log 2>/dev/null || echo 0)
    started=$(date +%s)
    "$@" >> worker.log 2>&1 < /dev/null &
    child=$!
    record "$child" > worker.pid.new && mv worker.pid.new worker.pid
    emit started ",\"pid\":$child,\"log_offset\":$((offset + 0))"
    wait "$child"
    code=$?
    # A trapped signal ends `wait` early; wait again until the worker itself has exited.
    while kill -0 "$child" 2>/dev/null; do
        wait "$child"
        code=$?
    done
    child=
    rm -f worker.pid
    if [ "$stopping" = 1 ]; then finish stopped ",\"code\":$code"; fi
    now=$(date +%s)
    emit exit ",\"code\":$code,\"ran_s\":$((now - started)),\"log_offset\":$((offset + 0))"
    # SIGILL (128 + 4): the binary uses instructions this CPU lacks (built with the wrong -march). It dies the same
    # way every time, so it is not restarted: the controller reports it once.
    if [ "$code" = 132 ]; then
        emit failed ",\"exits\":1,\"window_s\":$window,\"cause\":\"illegal-instruction\""
        rm -f supervisor.pid
        exit 1
    fi

    recent=0 kept=
    for t in $exits $now; do
        if [ $((now - t)) -lt "$window" ]; then recent=$((recent + 1)) kept="$kept $t"; fi
    done
    exits=$kept
    if [ "$recent" -ge "$max_exits" ]; then
        emit failed ",\"exits\":$recent,\"window_s\":$window"
        rm -f supervisor.pid
        exit 1
    fi

    # A worker that ran a while was healthy (a crash at start-up exits within seconds): start over from a
    # short backoff. Flapping is still caught by the crash-loop count above.
    if [ $((now - started)) -ge 10 ]; then backoff=1; fi
    emit backoff ",\"seconds\":$backoff"
    sleep "$backoff" &
    sleeper=$!
    wait "$sleeper" 2>/dev/null
    sleeper=
    if [ "$stopping" = 1 ]; then finish stopped; fi
    backoff=$((backoff * 2))
    if [ "$backoff" -gt "$max_backoff" ]; then backoff=$max_backoff; fi
done
