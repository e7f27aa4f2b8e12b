"""Process-wide settings the engine makes when it is imported.

* ``GOMP_SPINCOUNT=1000``: an idle OpenMP thread (torch's and the native kernels' pool,
  which is one libgomp) spins about 25 us for the next parallel region before it
  sleeps. libgomp's default spins for milliseconds, which stalls every region whenever
  another process or thread (the server's event loop, a load generator) holds a core;
  ``OMP_WAIT_POLICY=PASSIVE`` (no spin) makes the next region wake a sleeping thread,
  and a decode step runs ~150 regions a few to a hundred microseconds apart. Against
  PASSIVE, prefill steps took ~10% less time and decode steps the same or less on an
  idle 2-core machine, and the same with a busy loop on one of its cores (BENCHMARKS.md).
  Set only if neither ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY`` is set, and only
  effective before torch is imported.
* glibc ``malloc``: torch allocates every op's output with ``malloc``; glibc serves
  blocks over its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh ``mmap``
  and returns freed heap tops to the kernel, so a prefill step of a few thousand tokens
  page-faults its tens of MB of activations in again on every layer. Raising the mmap
  threshold to its maximum and keeping freed memory (trim threshold 1 GiB) cut the
  minor page faults of five 2048-token prefill steps from 685k to 31k and their time by
  18% (BENCHMARKS.md). The process keeps its peak activation memory instead of
  returning it. ``PAGEDSERVE_MALLOC_TUNING=0`` leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("engine.process_tuning")

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
ENV_VAR = "PAGEDSERVE_MALLOC_TUNING"
SPIN_COUNT = "1000"


def switched_off(env_var: str) -> bool:
    """Whether the user turned a default-on setting off (``0``, ``false``, ``no``, ``off``)."""
    return os.environ.get(env_var, "1").strip().lower() in ("0", "false", "no", "off")


def set_omp_spin() -> None:
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def tune_malloc() -> bool:
    """Apply the malloc settings above on glibc; returns whether they were applied."""
    if switched_off(ENV_VAR):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))  # fmt: skip
    if not ok:
        log.debug("mallopt refused a setting; malloc partly tuned")
    return ok
