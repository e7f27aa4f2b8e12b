#!/usr/bin/env bash
# pagedserve and llama.cpp's llama-server on the same GGUF file, one server at a time:
#   single stream, 128-token prompts: TTFT and ITL (8 requests, 128 tokens out each)
#   single stream, 4,096-token prompts: TTFT and ITL (2 requests, 64 tokens out)
#   32 streams, 128-token prompts: output tok/s (64 requests, 128 tokens out)
# Usage: scripts/vs_llama_server.sh FILE.gguf [OUT_DIR]
# llama-server: $LLAMA_SERVER, else /tmp/lcb/bin/llama-server (../shared/tools/
# build_llama_server.sh builds it). pagedserve serves the file with --quantization gguf;
# llama-server with one slot for the single-stream runs and 32 for the concurrent one,
# both with the host's cores. Each run's JSON (bench serve --save-result) and log go to
# OUT_DIR (default /tmp/vs_llama); the last lines print the figures side by side.
# SERVE_ARGS: more flags for pagedserve serve (e.g. --quantized-activations float);
# ONLY=pagedserve or ONLY=llamacpp runs one server's part. TURNS=N runs only the
# single-stream 128-token part, both servers in turn N times (on a host whose memory
# speed drifts, the ratio within each turn is the one to read).
set -uo pipefail
GGUF=${1:?usage: $0 FILE.gguf [OUT_DIR]}
OUT=${2:-/tmp/vs_llama}
LLAMA=${LLAMA_SERVER:-/tmp/lcb/bin/llama-server}
PS=${PAGEDSERVE:-pagedserve}
PORT=${PORT:-8765}
THREADS=$(nproc)
mkdir -p "$OUT"
[ -x "$LLAMA" ] || { echo "no llama-server at $LLAMA" >&2; exit 2; }

# shellcheck source=scripts/servers.sh
source "$(cd "$(dirname "$0")" && pwd)/servers.sh"
bench() {  # bench NAME IN OUT_TOKENS PROMPTS CONCURRENCY
    "$PS" bench serve --port "$PORT" --endpoint /v1/completions --dataset random \
        --random-input-len "$2" --random-output-len "$3" --num-prompts "$4" \
        --max-concurrency "$5" --num-warmups 1 --request-rate inf --seed 0 \
        --save-result "$OUT/$1.json" >"$OUT/$1.log" 2>&1 || echo "bench $1 failed: $OUT/$1.log" >&2
}
single() {  # single SERVER
    bench "${1}_128" 128 128 8 1
    bench "${1}_4096" 4096 64 2 1
}
start_llamacpp() {  # start_llamacpp NAME SLOTS CONTEXT
    start_server "$1" "$LLAMA" -m "$GGUF" -c "$3" -np "$2" -t "$THREADS" --port "$PORT"
}
start_pagedserve() {  # start_pagedserve NAME
    # shellcheck disable=SC2086
    start_server "$1" "$PS" serve --model "$GGUF" --quantization gguf --port "$PORT" \
        --max-num-seqs 64 --max-model-len 8192 ${SERVE_ARGS:-}
}

if [ -n "${TURNS:-}" ]; then
    for t in $(seq 1 "$TURNS"); do
        start_llamacpp "llamacpp_$t" 1 8192 && bench "llamacpp_turn$t" 128 128 8 1
        stop_server
        start_pagedserve "pagedserve_$t" && bench "pagedserve_turn$t" 128 128 8 1
        stop_server
    done
    python3 - "$OUT" "$TURNS" <<'EOF'
import json, sys
out, turns = sys.argv[1], int(sys.argv[2])
for t in range(1, turns + 1):
    try:
        p, l = (json.load(open(f"{out}/{name}_turn{t}.json"))["itl_ms"]["median"]
                for name in ("pagedserve", "llamacpp"))
    except (OSError, ValueError, KeyError):
        print(f"turn {t}: a run failed (see {out})")
        continue
    print(f"turn {t}: 128-token prompt, 1 stream: itl_ms.median pagedserve {p:.2f} "
          f"llama.cpp {l:.2f} ratio {p / l:.2f}")
EOF
    exit 0
fi

ONLY=${ONLY:-}
if [ "$ONLY" != pagedserve ]; then
    start_llamacpp llamacpp_1 1 8192 && single llamacpp
    stop_server
    start_llamacpp llamacpp_32 32 16384 && bench llamacpp_c32 128 128 64 32
    stop_server
fi
if [ "$ONLY" != llamacpp ]; then
    start_pagedserve pagedserve && {
        single pagedserve
        bench pagedserve_c32 128 128 64 32
    }
    stop_server
fi

python3 - "$OUT" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def get(name, key):
    try:
        r = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return float("nan")
    metric, _, stat = key.partition(".")
    value = r.get(metric, float("nan"))
    return value[stat] if stat else value
rows = [("128-token prompt, 1 stream", "_128", ("ttft_ms.median", "itl_ms.median")),
        ("4,096-token prompt, 1 stream", "_4096", ("ttft_ms.median", "itl_ms.median")),
        ("128-token prompts, 32 streams", "_c32", ("output_throughput", "itl_ms.median"))]
for title, suffix, keys in rows:
    for k in keys:
        p, l = get("pagedserve" + suffix, k), get("llamacpp" + suffix, k)
        print(f"{title}: {k} pagedserve {p:.2f} llama.cpp {l:.2f} ratio {p / l:.2f}")
EOF
