"""The CPU KV cache and packed weights on transparent huge pages.

A decode step reads every request's K/V rows through its block table: at 64 requests
of the default model, ~0.6 GB in 12 KiB blocks scattered over a 1 GiB pool. On 4 KiB
pages nearly every block starts with TLB misses, and under a hypervisor each miss walks
two page tables. With ``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise``
(the common default) only memory that asks for huge pages gets them, so :func:`empty`
asks (:func:`pagedserve.kernels.cpu.memory.huge_empty`: fresh anonymous memory advised
``MADV_HUGEPAGE``, the tensor on a 2 MiB boundary). 30 layers of decode attention at 64
requests took 2-8% less time (BENCHMARKS.md). The native linear's packed float32
weights (one tensor for all of them, :meth:`pagedserve.kernels.cpu.layer_ops.NativeLayerOps.
prepare_weights`) are read as long sequential panels, which the hardware prefetchers
stream without stopping at every 4 KiB page: one decode row's linears took 4-8% less
time on huge pages. ``PAGEDSERVE_HUGEPAGES=0`` turns both off (:func:`enabled`, reported
at engine start by :func:`pagedserve.engine.worker.process_tuning.apply`); elsewhere than Linux it does
nothing.
"""

from __future__ import annotations

import logging
import mmap
import platform

import torch

from pagedserve.engine import envs
from pagedserve.kernels.cpu.memory import HUGE_PAGE, advise_huge_pages, huge_empty

__all__ = ["HUGE_PAGE", "empty", "enabled"]

log = logging.getLogger("pagedserve.engine.worker.hugepages")


def enabled() -> bool:
    """Whether the CPU KV cache and packed weights ask for huge pages
    (``PAGEDSERVE_HUGEPAGES``, on Linux)."""
    return envs.hugepages() and platform.system() == "Linux" and hasattr(mmap, "MADV_HUGEPAGE")


def _try_advise(mm: mmap.mmap, length: int) -> None:
    """:func:`pagedserve.kernels.cpu.memory.advise_huge_pages`, a refusal logged instead of raised."""
    try:
        advise_huge_pages(mm, length)
    except OSError as exc:
        log.debug("madvise(MADV_HUGEPAGE) of %d bytes failed: %s", length, exc)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor on fresh memory (zeros), on huge pages where the kernel
    allows (:func:`pagedserve.kernels.cpu.memory.huge_empty`). Smaller than one huge page, or with
    huge pages off: ``torch.empty``."""
    if not enabled():
        return torch.empty(shape, dtype=dtype)
    return huge_empty(shape, dtype, _try_advise)
