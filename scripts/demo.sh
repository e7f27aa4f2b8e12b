#!/usr/bin/env bash
# Set up (if needed) and run the offline demo on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/inference_demo.py "$@"
