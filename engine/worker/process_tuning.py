"""Process-wide settings the engine applies explicitly (importing ``engine`` applies none).

* ``GOMP_SPINCOUNT=1000`` (:func:`set_omp_spin`): an idle OpenMP thread (torch's and
  the native kernels' pool, which is one libgomp) spins about 25 us for the next
  parallel region before it sleeps. libgomp's default spins for milliseconds, which
  stalls every region whenever another process or thread (the server's event loop, a
  load generator) holds a core; ``OMP_WAIT_POLICY=PASSIVE`` (no spin) makes the next
  region wake a sleeping thread, and a decode step runs ~150 regions a few to a hundred
  microseconds apart. Against PASSIVE, prefill steps took ~10% less time and decode
  steps the same or less on an idle 2-core machine, and the same with a busy loop on
  one of its cores (BENCHMARKS.md). libgomp reads the variable once, when torch loads
  it, so it is set only before torch is imported: the ``pagedserve`` command does so
  first thing (``pagedserve serve``, ``pagedserve bench ...``); a program of one's own
  exports it itself. Never set when ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is set.
* glibc ``malloc`` (:func:`tune_malloc`): torch allocates every op's output with
  ``malloc``; glibc serves blocks over its mmap threshold (128 KiB, adapting up to
  32 MiB) with fresh ``mmap`` and returns freed heap tops to the kernel, so a prefill
  step of a few thousand tokens page-faults its tens of MB of activations in again on
  every layer. Raising the mmap threshold to its maximum and keeping freed memory (trim
  threshold 1 GiB) cut the minor page faults of five 2048-token prefill steps from 685k
  to 31k and their time by 18% (BENCHMARKS.md). The process keeps its peak activation
  memory instead of returning it. ``PAGEDSERVE_MALLOC_TUNING=0`` leaves malloc alone.

:func:`apply` runs when an engine starts (``LLMEngine``, so ``LLM`` and the server too):
it tunes malloc and logs one line with what is in effect, the OpenMP spin (and whether
it was set in time), malloc and the KV cache's huge pages (:mod:`pagedserve.engine.worker.hugepages`).
This module imports only the standard library, so the command line can use it before
torch is loaded.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import platform
import sys
from dataclasses import dataclass

from pagedserve.engine import envs

log = logging.getLogger("pagedserve.engine.worker.process_tuning")

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
SPIN_COUNT = "1000"

_spin_set_in_time = False
"""Whether :func:`set_omp_spin` set ``GOMP_SPINCOUNT`` before torch was loaded."""


def set_omp_spin() -> bool:
    """Set ``GOMP_SPINCOUNT=1000`` if neither it nor ``OMP_WAIT_POLICY`` is set and torch
    (which loads libgomp) is not imported yet; returns whether it did."""
    global _spin_set_in_time
    if envs.omp_wait_policy() is not None or envs.gomp_spincount() is not None:
        return False
    if "torch" in sys.modules:
        return False
    envs.set_gomp_spincount(SPIN_COUNT)
    _spin_set_in_time = True
    return True


def omp_spin() -> str:
    """What decides the OpenMP threads' idle spin in this process, in words."""
    policy, spin = envs.omp_wait_policy(), envs.gomp_spincount()
    if _spin_set_in_time and spin == SPIN_COUNT:
        return f"GOMP_SPINCOUNT={SPIN_COUNT} (set before torch was loaded)"
    if policy is not None:
        return f"OMP_WAIT_POLICY={policy} (from the environment)"
    if spin is not None:
        return f"GOMP_SPINCOUNT={spin} (from the environment)"
    return (f"libgomp's default spin (torch was loaded before GOMP_SPINCOUNT={SPIN_COUNT} "
            "could be set; export it before starting Python)")  # fmt: skip


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc on Linux (whose malloc the functions below tune)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_malloc() -> bool:
    """Apply the malloc settings above on glibc; returns whether they were applied."""
    libc = _glibc() if envs.malloc_tuning() else None
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))  # fmt: skip
    if not ok:
        log.debug("mallopt refused a setting; malloc partly tuned")
    return ok


def return_free_memory() -> bool:
    """Give the heap's free memory back to the kernel now (glibc ``malloc_trim``), as
    the tuned malloc no longer does by itself: once, after loading, when the memory a
    load freed (a quantized model's planes, once packed) would otherwise stay with the
    process. Returns whether anything was returned."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


def freeze_startup_heap() -> None:
    """Move every object alive now out of the cyclic collector's reach (``gc.freeze``),
    after a garbage pass: for a process that serves one engine for its lifetime (the
    server, a data-parallel replica), once the engine has started. The collector's full
    passes hold the GIL, engine thread included; over the ~400k objects torch,
    transformers and the engine leave behind, one took 227-238 ms (a stall of every
    stream's next token), against 8-13 ms over what is allocated after the freeze
    (BENCHMARKS.md).
    :func:`unfreeze_heap` at exit.

    The second pass runs over nothing (everything is frozen) and resets the collector's
    count of long-lived objects: the first pass left it at the ~400k objects now frozen,
    and a full pass waits until a quarter of that count has been promoted since, so the
    cycles of finished requests (a request and its group refer to each other) would stay
    in memory for minutes of traffic before the first full pass."""
    gc.collect()
    gc.freeze()
    gc.collect()


def unfreeze_heap() -> None:
    """Make the frozen objects collectable again (at exit, so that extensions' objects
    are finalized)."""
    gc.unfreeze()


@dataclass(frozen=True)
class Tuning:
    """What :func:`apply` found and did."""

    omp_spin: str
    """:func:`omp_spin`."""
    malloc_tuned: bool
    """Whether malloc keeps freed memory (:func:`tune_malloc`)."""
    hugepages: bool
    """Whether the CPU KV cache asks for huge pages (:func:`pagedserve.engine.worker.hugepages.enabled`)."""

    def summary(self) -> str:
        malloc = "tuned (keeps freed memory)" if self.malloc_tuned else "left alone"
        huge = "on" if self.hugepages else "off"
        return (f"process tuning: OpenMP spin {self.omp_spin}; malloc {malloc}; "
                f"CPU KV cache huge pages {huge}")  # fmt: skip


def apply() -> Tuning:
    """At engine start: tune malloc; log and return what is in effect."""
    from pagedserve.engine.worker import hugepages

    tuning = Tuning(omp_spin(), tune_malloc(), hugepages.enabled())
    log.info("%s", tuning.summary())
    return tuning
