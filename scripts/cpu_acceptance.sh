#!/usr/bin/env bash
# The CPU benchmarks the open CPU issues accept on, in one run on this host, with their
# logs in one folder (each one's command is its log's first line):
#
#   bash scripts/cpu_acceptance.sh [OUT_DIR]      # default /tmp/cpu-acceptance; ~1-2 h
#   QUICK=1 bash scripts/cpu_acceptance.sh        # small sizes: checks the plumbing only
#   HF_CONTINUOUS=0 bash scripts/cpu_acceptance.sh # without HF continuous batching (the
#                                                  # issues compare with HF static only)
#
# 1. Every-CPU issue: `bench throughput --compare-hf` in float32 (--repeat 3) and bfloat16
#    (--repeat 1), with the chosen CPU paths in each header.
# 2. Long-prompt issue: `bench decode` at 7,800 prompt tokens (float32 and gguf): the step
#    against the time to read its KV cache and weights at the bandwidth read beside it.
# 3. Long-prompt issue: one request at a time at 7,800 and 128 prompt tokens, 64 output
#    tokens, against llama.cpp's llama-server on the same GGUF file (Q4_1), then
#    `pagedserve serve` with gguf and with float32 weights, one server at a time.
#    llama-server: $LLAMA_SERVER, else /tmp/lcb/bin/llama-server, else built there with
#    ../shared/tools/build_llama_server.sh (about 10 minutes on 2 cores); without one the
#    llama.cpp runs are skipped and the summary says so.
#
# Run it on a quiet machine: it is the only load the numbers should see.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-/tmp/cpu-acceptance}
mkdir -p "$OUT"
bash scripts/setup.sh >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
PS="$ROOT/.venv/bin/pagedserve"
PY="$ROOT/.venv/bin/python"
export GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-1000}

if [ "${QUICK:-0}" = 1 ]; then
    LONG=600 SHORT=32 OUTLEN=8 REPEAT=1 REQS=(--num-requests 8) STEPS=4
else
    LONG=7800 SHORT=128 OUTLEN=64 REPEAT=3 REQS=() STEPS=32
fi

run() {  # run LOG CMD...: the command, then its output, in OUT/LOG
    local log="$OUT/$1"
    shift
    echo "\$ $*" >"$log"
    echo "== $1 ${*:2}" >&2
    "$@" >>"$log" 2>&1
    local rc=$?
    [ $rc = 0 ] || echo "exit $rc" >>"$log"
    return 0
}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "git: $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (local changes)')"
    grep -m1 'model name' /proc/cpuinfo
    echo "cores: $(nproc)"
    echo "avx512: $(grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    echo "amx: $(grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
} >"$OUT/host.txt"
cat "$OUT/host.txt" >&2

# -- 1. throughput against HF static batching ---------------------------------------
HF=(--compare-hf)
[ "${HF_CONTINUOUS:-1}" = 0 ] && HF+=(--no-hf-continuous)
run throughput_float32.log "$PS" bench throughput --dtype float32 "${HF[@]}" \
    --repeat "$REPEAT" "${REQS[@]}" --save-result "$OUT/throughput_float32.json"
run throughput_bfloat16.log "$PS" bench throughput --dtype bfloat16 "${HF[@]}" \
    --repeat 1 "${REQS[@]}" --save-result "$OUT/throughput_bfloat16.json"

# -- 2. the long decode against its read time ---------------------------------------
weights() {  # weights float32|gguf: the engine flags of that choice of weights
    if [ "$1" = gguf ]; then echo --quantization gguf; else echo --dtype float32; fi
}
for q in float32 gguf; do
    # shellcheck disable=SC2046  # two words, split on purpose
    run "decode_${LONG}_$q.log" "$PS" bench decode --prompt-len "$LONG" --batch-sizes 1 \
        --steps "$STEPS" $(weights $q)
done

# -- 3. side by side with llama.cpp --------------------------------------------------
GGUF=$("$PY" -c 'from pagedserve.engine.loader.default_model import default_gguf_path; print(default_gguf_path())')
LLAMA=${LLAMA_SERVER:-/tmp/lcb/bin/llama-server}
TOOLS="$ROOT/../shared/tools/build_llama_server.sh"
if [ ! -x "$LLAMA" ] && [ "${QUICK:-0}" != 1 ] && [ -f "$TOOLS" ]; then
    run build_llama_server.log bash "$TOOLS" "$(dirname "$(dirname "$LLAMA")")"
fi
PORT=${PORT:-8765}
# shellcheck source=scripts/servers.sh
source "$ROOT/scripts/servers.sh"
side_by_side() {  # side_by_side NAME: the long then the short prompts at the running server
    for len in "$LONG" "$SHORT"; do
        n=2
        [ "$len" -ge 4096 ] && n=1
        run "serve_${1}_$len.log" "$PS" bench serve --port "$PORT" --endpoint /v1/completions \
            --dataset random --random-input-len "$len" --random-output-len "$OUTLEN" \
            --num-prompts $n --max-concurrency 1 --request-rate inf --seed 0 \
            --save-result "$OUT/serve_${1}_$len.json"
    done
}
if [ -x "$LLAMA" ]; then
    start_server llamacpp "$LLAMA" -m "$GGUF" -c 16384 -np 1 -t "$(nproc)" --port "$PORT" &&
        side_by_side llamacpp
    stop_server
else
    printf '$ %s (not found)\nthe llama.cpp runs are skipped\n' "$LLAMA" >"$OUT/serve_llamacpp_skipped.log"
    echo "no llama-server at $LLAMA: the llama.cpp runs are skipped" >&2
fi
for q in gguf float32; do
    # shellcheck disable=SC2046
    start_server "pagedserve_$q" "$PS" serve --port "$PORT" $(weights $q) &&
        side_by_side "pagedserve_$q"
    stop_server
done

# -- summary ------------------------------------------------------------------------
{
    cat "$OUT/host.txt"
    for f in "$OUT"/throughput_*.log "$OUT"/decode_*.log "$OUT"/serve_*.log; do
        [ -f "$f" ] || continue
        echo
        echo "### $(basename "$f")"
        head -1 "$f"
        grep -E "cpu kernels|ratio|ceiling|arithmetic:|read x|^ *1 |TTFT|ITL|Successful|Failed|exit [0-9]|skipped" "$f" | tail -25
    done
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
