#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite (CPU only; Triton kernels run under
# the Triton interpreter). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/steps.sh
# The page's browser test drives the system Chromium (Debian's `chromium`) with playwright.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  install_chromium() { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
  step "installing chromium (the page's browser test)" install_chromium \
    || echo "could not install chromium: the browser test will fail" >&2
fi
# Two worker processes where there are two cores (pytest-xdist; each test file runs whole
# in one of them, so a module's server or model is built once): the suite is mostly
# single-threaded Python between short two-thread bursts, and one process kept a core
# idle a third of the time (2-core Zen 4: 23.9 minutes in one process, 15.5 in two). Extra
# arguments go after these (`scripts/test.sh -n 0` runs in one process).
WORKERS=$(.venv/bin/python -c "import os; print(min(len(os.sched_getaffinity(0)), 2))" 2>/dev/null || echo 1)
ARGS=(-q --durations=25)
if [ "$WORKERS" -gt 1 ]; then
  ARGS+=(-n "$WORKERS" --dist loadfile)
fi
echo "running the test suite: .venv/bin/python -m pytest ${ARGS[*]} $*"
# The 25 slowest tests are listed at the end, so every CI log shows where its time went.
exec .venv/bin/python -m pytest "${ARGS[@]}" "$@"
