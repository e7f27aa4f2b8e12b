"""The CPU KV cache on transparent huge pages.

A decode step reads every request's K/V rows through its block table: at 64 requests
of the default model, ~0.6 GB in 12 KiB blocks scattered over a 1 GiB pool. On 4 KiB
pages nearly every block starts with TLB misses, and under a hypervisor each miss walks
two page tables. With ``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise``
(the common default) only memory that asks for huge pages gets them, so :func:`empty`
asks: it allocates with torch, aligns the tensor's start to 2 MiB inside a buffer 2 MiB
larger and calls ``madvise(MADV_HUGEPAGE)`` on it before its pages are first touched.
30 layers of decode attention at 64 requests took 2-8% less time (BENCHMARKS.md); the
packed weights, read as long sequential panels, gained nothing, so they stay as they are.
``PAGEDSERVE_HUGEPAGES=0`` turns this off; elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import platform

import torch

log = logging.getLogger("engine.hugepages")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
ENV_VAR = "PAGEDSERVE_HUGEPAGES"
_libc: ctypes.CDLL | None = None


def enabled() -> bool:
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return platform.system() == "Linux"


def _madvise(addr: int, length: int) -> int:
    """``madvise(addr, length, MADV_HUGEPAGE)``: 0, or the errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return 0 if _libc.madvise(addr, length, MADV_HUGEPAGE) == 0 else ctypes.get_errno()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where the kernel allows
    (smaller than one huge page, or with huge pages off: a plain ``torch.empty``)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not enabled():
        return torch.empty(shape, dtype=dtype)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    err = _madvise(raw.data_ptr() + offset, length)
    if err:
        log.debug("madvise(MADV_HUGEPAGE) of %d bytes failed: %s", length, os.strerror(err))
    return raw[offset: offset + nbytes].view(dtype).view(shape)
