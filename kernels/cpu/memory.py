"""CPU tensors on transparent huge pages: the memory of the CPU KV cache (through
:mod:`pagedserve.engine.worker.hugepages`, which decides whether to ask) and of the kernel benchmark's
caches, so that the benchmark reads K/V as the engine does.

With ``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise`` (the common default)
only memory that asks for huge pages gets them, so :func:`huge_empty` maps fresh
anonymous memory (never touched, so nothing is already on 4 KiB pages; ``malloc`` may
hand back reused heap memory), has it advised ``MADV_HUGEPAGE`` and starts the tensor on
a 2 MiB boundary.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

HUGE_PAGE = 2 << 20


def advise_huge_pages(mm: mmap.mmap, length: int) -> None:
    """Ask for huge pages over the mapping (where the platform has ``MADV_HUGEPAGE``)."""
    del length
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype,
               advise: Callable[[mmap.mmap, int], None] = advise_huge_pages) -> torch.Tensor:
    """A contiguous CPU tensor on fresh memory (zeros) starting on a 2 MiB boundary, after
    ``advise(mapping, length)`` (``length``: the bytes in whole huge pages). Smaller than
    one huge page: ``torch.empty``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # One huge page more than needed, so that the tensor can start on a 2 MiB boundary;
    # the tensor keeps the mapping alive, and unmapping it frees the memory.
    mm = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise(mm, length)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    return raw[offset: offset + nbytes].view(dtype).view(shape)
