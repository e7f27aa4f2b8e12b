#!/usr/bin/env bash
# Run a command as if this x86-64 host had AVX2 but no AVX-512 or AMX, to check the
# AVX2 paths on a machine that has more:
#
#   scripts/as_avx2_host.sh bash .ci/run
#   scripts/as_avx2_host.sh --print-cpuinfo    # the /proc/cpuinfo the command sees
#
# The command sees, through a private mount namespace, a /proc/cpuinfo without the
# avx512* and amx* flags: that file is what the native kernels' build levels and the
# chosen CPU paths are read from. torch's own kernels, oneDNN and MKL are held to AVX2
# (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS). What it cannot hide:
# the CPUID instruction, so checks that torch makes itself (oneDNN's bf16 weight packing)
# still see the wider units, and the host's speed, which is not an AVX2 machine's.
# Needs root or unprivileged user namespaces (unshare).
set -euo pipefail

strip_flags() { sed -E 's/[[:space:]](avx512|amx)[a-z0-9_]*//g' /proc/cpuinfo; }

case "${1:-}" in
"")
    echo "usage: $0 COMMAND [ARG...] | --print-cpuinfo" >&2
    exit 2
    ;;
--print-cpuinfo)
    strip_flags
    exit 0
    ;;
--inside)  # (in the new namespace)
    shift
    mount --bind "$AS_AVX2_CPUINFO" /proc/cpuinfo
    exec "$@"
    ;;
esac
if ! grep -qw avx2 /proc/cpuinfo; then
    echo "$0: this CPU has no AVX2 to keep" >&2
    exit 1
fi
AS_AVX2_CPUINFO=$(mktemp)
trap 'rm -f "$AS_AVX2_CPUINFO"' EXIT
strip_flags > "$AS_AVX2_CPUINFO"
export AS_AVX2_CPUINFO ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
    MKL_ENABLE_INSTRUCTIONS=AVX2
if [ "$(id -u)" = 0 ]; then ns=(-m); else ns=(-r -m); fi
unshare "${ns[@]}" "$0" --inside "$@"
