"""Reusable buffers for a step's inputs, so that the host's part of a step stays small.

:class:`StagingBuffer` packs every integer array of a step (token ids, positions, slots,
lengths, logits rows, block-table changes; the sampler's parameters and indices) into
one host buffer, pinned when the device is a GPU, and copies it to a device buffer of
the same layout in one non-blocking copy; the step's tensors are views of that device
buffer (on the CPU the host buffer is that buffer). Both buffers are reused from step
to step (reallocated only to grow), and every array starts at a multiple of 16 bytes,
so a kernel's pointer arguments keep their alignment, and their compiled variant.

:class:`BlockTableRows` keeps one device row of block ids per request while it runs and
writes only the entries added since the last step (a request appends blocks; when it
is preempted its row is released, and it is rewritten when it runs again). A step's
block table is a gather of its requests' rows, always ``width`` columns wide.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 16
"""Bytes each staged array is aligned to (what Triton specializes pointers on)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Pack:
    """The arrays of one staging, collected before the copy: :meth:`add` returns the
    array's index in the list of views :meth:`StagingBuffer.stage` returns."""

    __slots__ = ("arrays",)

    def __init__(self) -> None:
        self.arrays: list[tuple[Sequence[int] | np.ndarray, torch.dtype]] = []

    def add(self, values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype) -> int:
        self.arrays.append((values, dtype))
        return len(self.arrays) - 1


class StagingBuffer:
    """One host buffer and one device buffer of the same layout, reused every step."""

    def __init__(self, device: torch.device | str, capacity: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._copied: torch.cuda.Event | None = None
        self.num_stages = 0
        """Calls of :meth:`stage` (each one host-to-device copy off the CPU)."""
        self.num_copies = 0
        self._alloc(capacity)

    def _alloc(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._host_np = self.host.numpy()
        # On the CPU the host buffer is the device buffer: nothing to copy.
        self.dev = self.host if self.device.type == "cpu" else torch.empty(
            nbytes, dtype=torch.uint8, device=self.device)

    @property
    def capacity(self) -> int:
        return self.host.numel()

    def stage(self, arrays: Sequence[tuple[Sequence[int] | np.ndarray, torch.dtype]],
              into: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Device tensors holding ``arrays`` (values, dtype), after one host-to-device copy.

        ``into`` (a uint8 device tensor of at least :func:`layout`'s total) receives the
        copy instead of the staging's own device buffer: the CUDA graphs' static inputs
        are filled this way, their arrays first and at the offsets :func:`layout` gives.
        The views are valid until the next call (which overwrites the buffers, after the
        previous copy has finished reading the host buffer)."""
        sizes = [len(values) * dt.itemsize for values, dt in arrays]
        offsets, total = layout(sizes)
        if into is not None and total > into.numel():
            raise ValueError(f"{total} staged bytes do not fit the {into.numel()} of `into`")
        self.num_stages += 1
        if self._copied is not None:
            self._copied.synchronize()  # the copy in flight still reads the host buffer
        if total > self.capacity:
            self._alloc(max(total, 2 * self.capacity))
        for (values, dt), off, nbytes in zip(arrays, offsets, sizes, strict=True):
            if nbytes:
                self._host_np[off:off + nbytes].view(NUMPY_DTYPES[dt])[:] = values
        dest = self.dev if into is None else into
        if dest is not self.host:
            dest[:total].copy_(self.host[:total], non_blocking=True)
            self.num_copies += 1
        if self.pinned:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return [dest[off:off + nbytes].view(dt)
                for (_, dt), off, nbytes in zip(arrays, offsets, sizes, strict=True)]  # fmt: skip


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of arrays of ``sizes`` bytes packed one after another, each aligned to
    :data:`ALIGN`, and the bytes they take."""
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += _aligned(max(nbytes, 1))
    return offsets, total


NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
       torch.int16: np.int16, torch.uint8: np.uint8, torch.bool: np.bool_}  # fmt: skip
"""The numpy dtype of each torch dtype the staging takes."""


class RowPool:
    """Rows of a device table lent out per request id, with how many entries of each
    row are already written on the device. The table's owner grows the table, then the
    pool (:meth:`grow`), when no row is free."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.row_of: dict[str, int] = {}
        self.synced: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, key: str) -> int:
        """A free row for ``key``, nothing of it written yet."""
        row = self._free.pop()
        self.row_of[key], self.synced[key] = row, 0
        return row

    def release(self, key: str) -> None:
        row = self.row_of.pop(key, None)
        if row is not None:
            self.synced.pop(key)
            self._free.append(row)

    def grow(self, num_rows: int) -> None:
        """Rows ``[num_rows_before, num_rows)`` join the free ones (lent after them)."""
        self._free = list(range(num_rows - 1, self.num_rows - 1, -1)) + self._free
        self.num_rows = max(self.num_rows, num_rows)


class BlockTableRows:
    """Per-request rows of block ids on the device, updated incrementally."""

    def __init__(self, width: int, device: torch.device | str, num_rows: int = 16) -> None:
        if width < 1 or num_rows < 1:
            raise ValueError(f"width={width} and num_rows={num_rows} must be >= 1")
        self.device = torch.device(device)
        self.table = torch.zeros(num_rows, width, dtype=torch.int32, device=self.device)
        self.rows = RowPool(num_rows)
        """Each request's row, and its entries already written on the device."""

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def release(self, req_id: str) -> None:
        """Free a finished or preempted request's row."""
        self.rows.release(req_id)

    def changes(self, req_id: str, block_ids: list[int]) -> tuple[int, list[int], list[int]]:
        """The request's row, and the flat table indices and block ids to write this step
        (the entries past those already written)."""
        if len(block_ids) > self.width:
            raise ValueError(f"{len(block_ids)} blocks do not fit rows of {self.width}: "
                             "call ensure_width first")  # fmt: skip
        pool = self.rows
        row = pool.row_of.get(req_id)
        if row is None:
            if not pool.num_free:
                self._grow(2 * self.table.shape[0], self.width)
            row = pool.take(req_id)
        start = pool.synced[req_id]
        pool.synced[req_id] = len(block_ids)
        base = row * self.width
        return row, list(range(base + start, base + len(block_ids))), block_ids[start:]

    def ensure_width(self, num_blocks: int) -> None:
        """Widen the rows to ``num_blocks`` (before a step's :meth:`changes`; rare when
        the width covers ``max_model_len``)."""
        if num_blocks > self.width:
            self._grow(self.table.shape[0], max(num_blocks, 2 * self.width))

    def apply(self, flat_idx: torch.Tensor, values: torch.Tensor) -> None:
        """Write the staged changes (int64 flat indices, int32 block ids)."""
        if flat_idx.numel():
            self.table.view(-1).index_copy_(0, flat_idx, values)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The step's block table ``[len(rows), width]``."""
        return self.table.index_select(0, rows)

    def _grow(self, num_rows: int, width: int) -> None:
        """Reallocate with the entries kept (rare: more running requests or longer tables
        than sized for). Rows are added at the end: flat indices of a row stay valid
        unless the width changes."""
        old = self.table
        width = max(width, old.shape[1])
        self.table = torch.zeros(num_rows, width, dtype=torch.int32, device=self.device)
        self.table[: old.shape[0], : old.shape[1]] = old
        self.rows.grow(num_rows)
