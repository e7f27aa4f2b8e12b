#!/usr/bin/env bash
# Start a pagedserve server on a free port, run Locust headless against it for a bounded
# time, save the CSV and HTML reports under results/locust/, and stop the server on exit.
#
# Environment (all optional):
#   LOCUST_USERS        concurrent users (default 8)
#   LOCUST_SPAWN_RATE   users started per second (default 2)
#   LOCUST_RUN_TIME     run time, Locust syntax (default 60s)
#   LOCUST_RESULTS      output folder (default results/locust)
#   SERVE_ARGS          extra flags for `pagedserve serve` (default: none; the default model)
#   READY_TIMEOUT       seconds to wait for the server's ready line (default 300)
#   PYTHON              interpreter (default: .venv/bin/python if present, else python3)
#   PAGEDSERVE_LOCUST_* prompt set, output length, stream ratio, think time: see
#                       loadtest/locustfile.py
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
USERS="${LOCUST_USERS:-8}"
SPAWN_RATE="${LOCUST_SPAWN_RATE:-2}"
RUN_TIME="${LOCUST_RUN_TIME:-60s}"
RESULTS="${LOCUST_RESULTS:-results/locust}"
READY_TIMEOUT="${READY_TIMEOUT:-300}"
mkdir -p "$RESULTS"
LOG="$RESULTS/server.log"

# shellcheck disable=SC2086
PYTHONSAFEPATH=1 "$PYTHON" -m pagedserve.server.cli serve --host 127.0.0.1 --port 0 ${SERVE_ARGS:-} >"$LOG" 2>&1 &
SERVER_PID=$!
stop_server() {
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    wait "$SERVER_PID" 2>/dev/null || true
}
trap stop_server EXIT INT TERM

URL=""
for _ in $(seq "$((READY_TIMEOUT * 2))"); do
    URL="$(grep -o 'pagedserve ready on http://[^ ]*' "$LOG" | head -n1 | awk '{print $4}')" || true
    [ -n "$URL" ] && break
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "the server exited before it was ready:" >&2; cat "$LOG" >&2; exit 1
    fi
    sleep 0.5
done
if [ -z "$URL" ]; then
    echo "the server was not ready after ${READY_TIMEOUT}s:" >&2; tail -n 20 "$LOG" >&2; exit 1
fi
echo "server ready at $URL; locust: $USERS users for $RUN_TIME -> $RESULTS/"

"$PYTHON" -m locust -f loadtest/locustfile.py --host "$URL" --headless \
    --users "$USERS" --spawn-rate "$SPAWN_RATE" --run-time "$RUN_TIME" --stop-timeout 30 \
    --csv "$RESULTS/locust" --html "$RESULTS/report.html" --only-summary
