# One server at a time on $PORT, its log at $OUT/server_NAME.log (sourced by the scripts
# that run servers side by side; set PORT and OUT first).
SERVER_PID=
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=
}
trap stop_server EXIT
start_server() {  # start_server NAME CMD...: start, and wait up to 10 minutes for /health
    "${@:2}" >"$OUT/server_$1.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 1200); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.5
    done
    echo "server $1 did not start: see $OUT/server_$1.log" >&2
    stop_server
    return 1
}
