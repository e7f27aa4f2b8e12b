#!/usr/bin/env bash
# Checks of the CUDA execution path on a GPU machine, in one run of under 8 minutes.
#
# Parts, in this order (the most informative first), each under its own `timeout` of
# LIMIT[part] seconds (their sum fits the default budget; a dry run checks that), and
# skipped when the overall budget is spent:
#   env          nvidia-smi, python / torch / triton / transformers versions, CUDA visible
#   engine       tests/engine/worker/test_triton_engine.py (Triton engine + decode CUDA graphs vs the
#                torch backend, float32; LoRA adapters and embeddings on both) and
#                tests/engine/worker/test_gpu_path.py and test_gpu_memory.py
#   gate         the bf16 gate (scripts/gpu_gate.py): Triton + graphs vs Triton eager vs the
#                torch backend (batches 3/17/255, 3K+ prompts), head dims 64-128 and GQA
#                groups 1/7/16 and a KV cache past 2^31 elements against the torch
#                reference, compiles after warm-up, the decode step's time split
#   bench-model  a random-weight Llama-3.2-1B-shaped model (bf16) with a synthetic tokenizer
#   bench        `pagedserve bench throughput` (pagedserve.loadtest.throughput) on that model with
#                decode CUDA graphs, then (bench-eager) with --enforce-eager; the KV-budget
#                profile lines
#   bandwidth    Triton paged decode attention: K/V bytes read / kernel time, against
#                the H200's 4.8 TB/s and a measured device copy
#   kernels      tests/kernels/triton/test_kernels.py compiled on the GPU (no TRITON_INTERPRET)
#   hf-eq        engine vs HF transformers greedy tokens on tiny random Llama / Qwen2 /
#                Qwen3 models on the GPU: float32 exact (graphs and eager), bf16 reported
# At the end it prints ONE summary block and writes it to $OUT/gpu_summary.txt (and the
# full log to $OUT/gpu_check.log) when $OUT is set; the summary is rewritten after every
# part, so a run cut short still leaves one.
#
# The machine has no network: nothing is pip-installed from the internet. The repository
# is used in place through PYTHONPATH (equivalent to `pip install --no-deps
# --no-build-isolation -e .`: a folder whose pagedserve/ links to the package folders);
# models are random weights written on the machine, so no
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
# `bash scripts/gpu_check.sh --dry-run` runs on any machine, GPU or not: every part parses
# its arguments and does its set-up (pytest parts collect their tests), then stops before
# its first CUDA call and says so; it fails when a part fails to set up or when the parts'
# limits do not fit the budget. CI runs it on a CPU-only machine.
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S (default 450: parts start only
# while time is left; each is cut at its own limit or at the budget), GPU_CHECK_PARTS
# (space-separated subset of the part names above, default all).
set -uo pipefail

DRY_RUN=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        *) echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
ALL_PARTS="env engine gate bench-model bench bench-eager bandwidth kernels hf-eq"
# Seen on an H200 (2026-12-04): env 8-13 s, engine 31-36, gate 73-110 (alone), bench-model
# 15-19, bench 21-30, bench-eager 17-26, bandwidth 7-9, kernels 26-35, hf-eq 40-48; the
# engine part has since gained a LoRA and embeddings test (two more engines) and a GPTQ
# act-order checkpoint test (two more, small).
declare -A LIMIT=([env]=15 [engine]=75 [gate]=125 [bench-model]=30 [bench]=40 [bench-eager]=35
    [bandwidth]=25 [kernels]=50 [hf-eq]=55)
PARTS=${GPU_CHECK_PARTS:-$ALL_PARTS}
START=$SECONDS
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
LOG=$WORK/gpu_check.log
STATUS=$WORK/status.txt
export GPU_CHECK_SUMMARY=$WORK/results.txt
: >"$STATUS"
: >"$GPU_CHECK_SUMMARY"

unset TRITON_INTERPRET
export GPU_CHECK_DRY_RUN=$DRY_RUN
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The checkout under the one name it installs as: pagedserve/ with a link to each package
# folder (the repository root itself is not put first on the path: its folders' bare names,
# `kernels` among them, would shadow installed distributions of those names).
mkdir -p "$WORK/src/pagedserve"
ln -s "$ROOT/pagedserve/__init__.py" "$WORK/src/pagedserve/__init__.py"
for d in engine blockmgr kernels server loadtest; do ln -s "$ROOT/$d" "$WORK/src/pagedserve/$d"; done
export PYTHONPATH=$WORK/src${PYTHONPATH:+:$PYTHONPATH}
# Nor the working folder (`python -m`, `-c`): scripts/gpu_check.py adds what it needs.
export PYTHONSAFEPATH=1
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
DRY_NOTE="stopped before the first CUDA call"

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
        echo "$LIMITS_LINE"
        echo "total $(elapsed)s of a ${BUDGET}s budget; overall: $([ "$FAILED" = 0 ] && echo PASS || echo FAIL)$([ "$DRY_RUN" = 1 ] && echo ' (dry run)')"
        echo "================================"
    } >"$out"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"
        cp "$out" "$OUT/gpu_summary.txt"
        cp "$LOG" "$OUT/gpu_check.log" 2>/dev/null || true
    fi
}

# The parts' limits must fit the budget: a run never starts a part it cannot finish.
SUM_LIMITS=0
for p in $PARTS; do
    if [ -z "${LIMIT[$p]:-}" ]; then
        echo "unknown part $p in GPU_CHECK_PARTS (parts: $ALL_PARTS)" >&2
        exit 2
    fi
    SUM_LIMITS=$((SUM_LIMITS + LIMIT[$p]))
done
if ((SUM_LIMITS > BUDGET)); then
    LIMITS_LINE="part limits sum to ${SUM_LIMITS}s: OVER the ${BUDGET}s budget"
    FAILED=1
else
    LIMITS_LINE="part limits sum to ${SUM_LIMITS}s, within the ${BUDGET}s budget"
fi
echo "$LIMITS_LINE" | tee -a "$LOG"

# part NAME NOTE_CMD -- CMD...: run CMD under `timeout` (LIMIT[NAME] seconds), record
# PASS/FAIL/TIMEOUT (DRY-RUN for a dry run that set up); NOTE_CMD (a function name or
# "none") turns the part's log into a one-line note.
part() {
    local name=$1 limit=${LIMIT[$1]} note=$2
    shift 3
    if ! wanted "$name"; then
        return 0
    fi
    local left=$((BUDGET - $(elapsed)))
    if ((DRY_RUN == 0 && left < 20)); then
        printf '%-12s %-8s %4ss  %s\n' "$name" SKIPPED 0 "out of time budget" >>"$STATUS"
        FAILED=1
        write_summary
        return 0
    fi
    ((DRY_RUN == 0 && limit > left)) && limit=$left
    local plog=$WORK/$name.log t0=$SECONDS rc st extra=""
    echo "=== [$(elapsed)s] $name (limit ${limit}s): $*" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$plog"
    rc=${PIPESTATUS[0]}
    cat "$plog" >>"$LOG"
    case $rc in
        0) st=PASS; ((DRY_RUN)) && st=DRY-RUN ;;
        124 | 137) st=TIMEOUT ;;
        *) st="FAIL($rc)" ;;
    esac
    [ "$rc" = 0 ] || FAILED=1
    if [ "$note" != none ]; then
        extra=$("$note" "$plog")
    fi
    if ((DRY_RUN)); then
        extra=$(grep -o 'dry run: .*' "$plog" | tail -n 1)
        [ -n "$extra" ] || extra="dry run: NO dry-run line (the part ran past its set-up?)"
        [ "$rc" = 0 ] && ! grep -q "$DRY_NOTE" <<<"$extra" && FAILED=1
    fi
    printf '%-12s %-8s %4ss  %s\n' "$name" "$st" $((SECONDS - t0)) "$extra" >>"$STATUS"
    write_summary
    return 0
}

# shellcheck disable=SC2317  # called through part()
pytest_note() { grep -E '[0-9]+ (passed|failed|error|skipped)' "$1" | tail -n 1 | tr -d '='; }

# pytest ARGS...: the tests, or in a dry run their collection only (no test body runs).
# shellcheck disable=SC2317
run_pytest() {
    if ((DRY_RUN)); then
        local out
        out=$("$PY" -m pytest -q -p no:cacheprovider --collect-only "$@" 2>&1) || {
            echo "$out"
            return 1
        }
        echo "dry run: $(grep -oE '[0-9]+ tests? collected' <<<"$out" | tail -n 1) from" \
            "$(printf '%s\n' "$@" | grep '\.py$' | tr '\n' ' '); $DRY_NOTE"
        return 0
    fi
    "$PY" -m pytest -q -p no:cacheprovider "$@"
}

# -- env ------------------------------------------------------------------------------
# shellcheck disable=SC2317  # called through part() in a child bash
env_check() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    "$PY" - <<'EOF'
import os
import platform
import torch

print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for mod in ("triton", "transformers", "tokenizers", "safetensors", "pytest", "xdist"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except ImportError as exc:
        print(mod, "MISSING", exc)
if os.environ.get("GPU_CHECK_DRY_RUN") == "1":
    print("dry run: versions read; stopped before the first CUDA call (device query)")
    raise SystemExit(0)
assert torch.cuda.is_available(), "no CUDA device visible to torch"
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
      f"capability {p.major}.{p.minor}")
EOF
}

export -f env_check run_pytest
export PY DRY_RUN DRY_NOTE

# The tree of the files as they are here (`git write-tree` through a scratch index): equal
# to `git log --format=%T` of the commit whose files these are, even where the checkout's
# .git is older than its files (a device machine may be sent a newer working tree).
files_tree() {
    local idx
    idx=$(mktemp -u /tmp/gpu_check_index.XXXXXX)
    GIT_INDEX_FILE=$idx git add -A . >/dev/null 2>&1 && GIT_INDEX_FILE=$idx git write-tree 2>/dev/null
    rm -f "$idx"
}
TREE=$(files_tree)
HEADER="commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+local changes'); files: tree ${TREE:0:12} (git log --format=%T); started $(date -u +%FT%TZ)"
if wanted env; then
    part env none -- bash -c env_check
    HEADER="$HEADER
$(grep -E '^(python|device|triton|transformers) ' "$WORK/env.log" | tr '\n' ';' | sed 's/;$//')"
    if ((DRY_RUN == 0)) && ! grep -q '^device ' "$WORK/env.log"; then
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

part engine pytest_note -- bash -c 'run_pytest "$@"' run_pytest \
    tests/engine/worker/test_triton_engine.py tests/engine/worker/test_gpu_path.py \
    tests/engine/worker/test_gpu_memory.py
part gate none -- "$PY" scripts/gpu_check.py gate --workdir "$WORK"
MODEL=$WORK/llama-1b-random
part bench-model none -- "$PY" scripts/gpu_check.py make-model --preset llama-1b \
    --out "$MODEL" --device cuda --save-dtype bfloat16
BENCH=(--model "$MODEL" --dtype bfloat16 --max-num-seqs 256 --num-requests 512
    --input-len-min 32 --input-len-max 256 --output-len-min 64 --output-len-max 128 --seed 0)
for name in bench bench-eager; do
    eager=()
    [ "$name" = bench-eager ] && eager=(--enforce-eager)
    if ! wanted "$name"; then
        continue
    elif ((DRY_RUN)) || [ -f "$MODEL/model.safetensors" ]; then
        part "$name" none -- "$PY" scripts/gpu_check.py bench "${eager[@]}" "${BENCH[@]}"
    else
        printf '%-12s %-8s %4ss  %s\n' "$name" SKIPPED 0 "no bench model" >>"$STATUS"
        FAILED=1
    fi
done
part bandwidth none -- "$PY" scripts/gpu_check.py bandwidth --device cuda
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=(-n 8)
fi
part kernels pytest_note -- bash -c 'run_pytest "$@"' run_pytest "${XDIST[@]}" \
    tests/kernels/triton/test_kernels.py
part hf-eq none -- "$PY" scripts/gpu_check.py hf-equivalence

write_summary
echo
cat "$WORK/gpu_summary.txt"
exit "$FAILED"
