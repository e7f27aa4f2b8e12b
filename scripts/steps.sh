# Sourced by the set-up scripts: `step "what it does" command ...` prints one line for the
# step and keeps the command's output (pip's notices, build warnings) out of the way; when
# the command fails, its whole output is printed and the step returns its status (under
# `set -e` the script stops there).
step() {
  local what=$1 log rc t0=$SECONDS
  shift
  log=$(mktemp)
  printf '%s ... ' "$what"
  if "$@" >"$log" 2>&1; then
    echo "done ($((SECONDS - t0)) s)"
    rm -f "$log"
  else
    rc=$?
    echo "failed (exit $rc): $*"
    cat "$log" >&2
    rm -f "$log"
    return "$rc"
  fi
}
