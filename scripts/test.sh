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
echo "running the test suite: .venv/bin/python -m pytest -q --durations=25 $*"
# The 25 slowest tests are listed at the end, so every CI log shows where its time went.
# One process: on the 2-core CI host two pytest-xdist workers (--dist loadfile) took as
# long as one (54.7 against 53.9 minutes; the heavy tests already use both cores).
exec .venv/bin/python -m pytest -q --durations=25 "$@"
