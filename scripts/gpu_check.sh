#!/usr/bin/env bash
# Checks of the CUDA execution path on a GPU machine, in one run of under 8 minutes.
#
# Parts (each under its own `timeout`, skipped when the overall budget is spent):
#   env          nvidia-smi, python / torch / triton / transformers versions, CUDA visible
#   kernels      tests/kernels/triton/test_kernels.py compiled on the GPU (no TRITON_INTERPRET)
#   engine       tests/engine/test_triton_engine.py (Triton engine + decode CUDA graphs vs the
#                torch backend, float32) and tests/engine/test_gpu_path.py
#   hf-eq        engine vs HF transformers greedy tokens on tiny random Llama / Qwen2 /
#                Qwen3 models on the GPU: float32 exact (graphs and eager), bf16 reported
#   bandwidth    Triton paged decode attention: K/V bytes read / kernel time, against
#                the H200's 4.8 TB/s and a measured device copy
#   bench-model  a random-weight Llama-3.2-1B-shaped model (bf16) with a synthetic tokenizer
#   bench        `pagedserve bench throughput` (loadtest.throughput) on that model with
#                decode CUDA graphs, then with --enforce-eager; the KV-budget profile lines
# At the end it prints ONE summary block and writes it to $OUT/gpu_summary.txt (and the
# full log to $OUT/gpu_check.log) when $OUT is set; the summary is rewritten after every
# part, so a run cut short still leaves one.
#
# The machine has no network: nothing is pip-installed from the internet. The repository
# is used in place through PYTHONPATH (equivalent to `pip install --no-deps
# --no-build-isolation -e .`); models are random weights written on the machine, so no
# model files travel. Everything the parts import (torch, triton, transformers,
# tokenizers, safetensors, huggingface_hub, tqdm, pytest, pytest-xdist) is in the H200
# image. To use other versions of pure-Python packages (or ones an image lacks, e.g.
# msgspec for the server), carry wheels in .whl/ (ignored by git). Prepare them here:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION
#
# (pure-Python wheels match any platform; name each missing dependency too, one version
# of each). This script installs whatever .whl/*.whl holds into /tmp/site, offline.
#
# Run it through the device tool from the repository root, e.g.
#   run(command="bash scripts/gpu_check.sh", timeout_s=560)          # no carry needed
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=560)
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S (default 450: parts start only
# while time is left; each is cut at its own limit or at the budget), GPU_CHECK_PARTS
# (space-separated subset of the part names above, default all).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
PARTS=${GPU_CHECK_PARTS:-"env kernels engine hf-eq bandwidth bench-model bench"}
START=$SECONDS
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
LOG=$WORK/gpu_check.log
STATUS=$WORK/status.txt
export GPU_CHECK_SUMMARY=$WORK/results.txt
: >"$STATUS"
: >"$GPU_CHECK_SUMMARY"

unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PAGEDSERVE_CACHE=$WORK/cache

if compgen -G ".whl/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1; then
        export PYTHONPATH=$PYTHONPATH:/tmp/site
        echo "wheels installed into /tmp/site: $(cd .whl && echo *.whl)" | tee -a "$LOG"
    else
        echo "WARNING: installing .whl/*.whl failed (see $LOG)" | tee -a "$LOG"
    fi
fi

FAILED=0
HEADER=""

wanted() { [[ " $PARTS " == *" $1 "* ]]; }

elapsed() { echo $((SECONDS - START)); }

write_summary() {
    local out=$WORK/gpu_summary.txt
    {
        echo "===== pagedserve GPU check ====="
        echo "$HEADER"
        echo "-- parts --"
        cat "$STATUS"
        echo "-- results --"
        cat "$GPU_CHECK_SUMMARY"
        echo "total $(elapsed)s of a ${BUDGET}s budget; overall: $([ "$FAILED" = 0 ] && echo PASS || echo FAIL)"
        echo "================================"
    } >"$out"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"
        cp "$out" "$OUT/gpu_summary.txt"
        cp "$LOG" "$OUT/gpu_check.log" 2>/dev/null || true
    fi
}

# part NAME LIMIT_S NOTE_CMD -- CMD...: run CMD under `timeout`, record PASS/FAIL/TIMEOUT;
# NOTE_CMD (a function name or "none") turns the part's log into a one-line note.
part() {
    local name=$1 limit=$2 note=$3
    shift 4
    if ! wanted "$name"; then
        return 0
    fi
    local left=$((BUDGET - $(elapsed)))
    if ((left < 20)); then
        printf '%-12s %-8s %4ss  %s\n' "$name" SKIPPED 0 "out of time budget" >>"$STATUS"
        FAILED=1
        write_summary
        return 0
    fi
    ((limit > left)) && limit=$left
    local plog=$WORK/$name.log t0=$SECONDS rc st extra=""
    echo "=== [$(elapsed)s] $name (limit ${limit}s): $*" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$plog"
    rc=${PIPESTATUS[0]}
    cat "$plog" >>"$LOG"
    case $rc in
        0) st=PASS ;;
        124 | 137) st=TIMEOUT ;;
        *) st="FAIL($rc)" ;;
    esac
    [ "$rc" = 0 ] || FAILED=1
    if [ "$note" != none ]; then
        extra=$("$note" "$plog")
    fi
    printf '%-12s %-8s %4ss  %s\n' "$name" "$st" $((SECONDS - t0)) "$extra" >>"$STATUS"
    write_summary
    return 0
}

# shellcheck disable=SC2317  # called through part()
pytest_note() { grep -E '[0-9]+ (passed|failed|error|skipped)' "$1" | tail -n 1 | tr -d '='; }

# -- env ------------------------------------------------------------------------------
# shellcheck disable=SC2317  # called through part() in a child bash
env_check() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    "$PY" - <<'EOF'
import platform
import torch

print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for mod in ("triton", "transformers", "tokenizers", "safetensors", "pytest", "xdist"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except ImportError as exc:
        print(mod, "MISSING", exc)
assert torch.cuda.is_available(), "no CUDA device visible to torch"
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
      f"capability {p.major}.{p.minor}")
EOF
}

export -f env_check
export PY

HEADER="commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+local changes'); started $(date -u +%FT%TZ)"
if wanted env; then
    part env 60 none -- bash -c env_check
    HEADER="$HEADER
$(grep -E '^(python|device|triton|transformers) ' "$WORK/env.log" | tr '\n' ';' | sed 's/;$//')"
    if ! grep -q '^device ' "$WORK/env.log"; then
        echo "no usable CUDA device: stopping" | tee -a "$GPU_CHECK_SUMMARY"
        FAILED=1
        write_summary
        cat "$WORK/gpu_summary.txt"
        exit 1
    fi
fi

XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=(-n 8)
fi

part kernels 150 pytest_note -- "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
    tests/kernels/triton/test_kernels.py
part engine 100 pytest_note -- "$PY" -m pytest -q -p no:cacheprovider \
    tests/engine/test_triton_engine.py tests/engine/test_gpu_path.py
part hf-eq 120 none -- "$PY" scripts/gpu_check.py hf-equivalence
part bandwidth 60 none -- "$PY" scripts/gpu_check.py bandwidth --device cuda
MODEL=$WORK/llama-1b-random
part bench-model 60 none -- "$PY" scripts/gpu_check.py make-model --preset llama-1b \
    --out "$MODEL" --device cuda --save-dtype bfloat16
BENCH=(--model "$MODEL" --dtype bfloat16 --max-num-seqs 256 --num-requests 512
    --input-len-min 32 --input-len-max 256 --output-len-min 64 --output-len-max 128 --seed 0)
if wanted bench && [ -f "$MODEL/model.safetensors" ]; then
    part bench 90 none -- "$PY" scripts/gpu_check.py bench "${BENCH[@]}"
    PARTS="$PARTS bench-eager"
    part bench-eager 90 none -- "$PY" scripts/gpu_check.py bench --enforce-eager "${BENCH[@]}"
elif wanted bench; then
    printf '%-12s %-8s %4ss  %s\n' bench SKIPPED 0 "no bench model" >>"$STATUS"
    FAILED=1
fi

write_summary
echo
cat "$WORK/gpu_summary.txt"
exit "$FAILED"
