"""The CPU KV cache on transparent huge pages.

A decode step reads every request's K/V rows through its block table: at 64 requests
of the default model, ~0.6 GB in 12 KiB blocks scattered over a 1 GiB pool. On 4 KiB
pages nearly every block starts with TLB misses, and under a hypervisor each miss walks
two page tables. With ``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise``
(the common default) only memory that asks for huge pages gets them, so :func:`empty`
asks: it maps fresh anonymous memory (never touched, so nothing is already on 4 KiB
pages; ``malloc`` may hand back reused heap memory), advises ``MADV_HUGEPAGE`` and starts
the tensor on a 2 MiB boundary. 30 layers of decode attention at 64 requests took 2-8%
less time (BENCHMARKS.md); the packed weights, read as long sequential panels, gained
nothing, so they stay as they are. ``PAGEDSERVE_HUGEPAGES=0`` turns this off
(:func:`enabled`, reported at engine start by :func:`engine.process_tuning.apply`);
elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import logging
import math
import mmap
import platform

import torch

from blockmgr import cdiv
from engine import envs

log = logging.getLogger("engine.hugepages")

HUGE_PAGE = 2 << 20


def enabled() -> bool:
    """Whether the CPU KV cache asks for huge pages (``PAGEDSERVE_HUGEPAGES``, on Linux)."""
    return envs.hugepages() and platform.system() == "Linux" and hasattr(mmap, "MADV_HUGEPAGE")


def _advise(mm: mmap.mmap) -> None:
    mm.madvise(mmap.MADV_HUGEPAGE)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor on fresh memory (zeros), on huge pages where the kernel
    allows. Smaller than one huge page, or with huge pages off: ``torch.empty``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not enabled():
        return torch.empty(shape, dtype=dtype)
    length = cdiv(nbytes, HUGE_PAGE) * HUGE_PAGE
    # One huge page more than needed, so that the tensor can start on a 2 MiB boundary;
    # the tensor keeps the mapping alive, and unmapping it frees the memory.
    mm = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        _advise(mm)
    except OSError as exc:
        log.debug("madvise(MADV_HUGEPAGE) of %d bytes failed: %s", length, exc)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    return raw[offset: offset + nbytes].view(dtype).view(shape)
