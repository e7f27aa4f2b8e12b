"""A compact picture of the block pool: one byte per block, block tables as runs.

Each block's byte is ``min(ref_count, 127) << 1 | cached``: ``0`` free, ``1`` free but
holding a prefix-cache key (hittable until reused), ``>= 2`` in use (``ref_count``
requests hold it; ``>= 4`` shared), the low bit set when it is keyed in the prefix cache.
A pool larger than the picture asked for is summarized: each cell covers
``blocks_per_cell`` consecutive blocks and shows the strongest state among them (shared,
then in use, then free) as a block byte with ref count 2, 1 or 0, its low bit set if any
of them is keyed (a summarized ``1`` is a run of free blocks holding cached prefixes).

A block table becomes a list of ``[first_block, count]`` runs of consecutive ids, so the
tables of a fresh pool cost a few numbers each.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.blockmgr.block_pool import BlockPool
from pagedserve.blockmgr.util import cdiv

MAX_REF_COUNT = 127
"""Ref counts above this are reported as this (the byte has 7 bits for them)."""

_DOUBLE = bytes(min(v, MAX_REF_COUNT) << 1 for v in range(256))
"""``bytes.translate`` table: a ref count byte -> its clamped, shifted state byte."""
_KEYED, _USED, _SHARED = 1, 2, 4
_CLASS = bytes((v & 1) | (_USED if v >> 1 == 1 else _SHARED if v >> 1 > 1 else 0)
               for v in range(256))
"""A block byte -> its state bits (keyed, in use by one, shared), which OR together."""
_CELL = bytes((m & _KEYED) | (4 if m & _SHARED else 2 if m & _USED else 0) for m in range(256))
"""OR-ed state bits -> the summarized cell byte."""


def encode_blocks(pool: BlockPool) -> bytearray:
    """One byte per block, in block-id order (see the module docstring)."""
    try:
        counts = bytearray(pool.ref_counts)
    except ValueError:  # a ref count over 255
        counts = bytearray(min(r, MAX_REF_COUNT) for r in pool.ref_counts)
    out = counts.translate(_DOUBLE)
    if not pool.cached:
        return out
    # The keyed bits of all blocks OR-ed in at once, as integers (the shifted ref counts
    # leave the low bit free).
    merged = int.from_bytes(out, "big") | int.from_bytes(pool.keyed, "big")
    return bytearray(merged.to_bytes(len(out), "big"))


def summarize(cells: bytearray, max_cells: int) -> tuple[bytes, int]:
    """``(cells, blocks_per_cell)``: at most ``max_cells`` cells, each summarizing its
    ``blocks_per_cell`` blocks (the last cell may cover fewer; see the module docstring)."""
    if max_cells <= 0:
        raise ValueError(f"max_cells must be positive, got {max_cells}")
    n = len(cells)
    if n <= max_cells:
        return bytes(cells), 1
    per = cdiv(n, max_cells)
    num_cells = cdiv(n, per)
    bits = cells.translate(_CLASS) + bytes(num_cells * per - n)
    if num_cells < per:  # few wide cells: OR each cell's bits
        acc = bytes(_or_all(bits[i:i + per]) for i in range(0, len(bits), per))
    else:  # many narrow cells: OR the k-th blocks of every cell at once, as integers
        merged = 0
        for k in range(per):
            merged |= int.from_bytes(bits[k::per], "big")
        acc = merged.to_bytes(num_cells, "big")
    return acc.translate(_CELL), per


def summarize_marks(marks: bytes | bytearray, blocks_per_cell: int) -> bytes:
    """A per-block 0/1 mark (such as :attr:`BlockPool.loaded`) per cell: 1 where any of the
    cell's ``blocks_per_cell`` blocks is marked."""
    if blocks_per_cell == 1:
        return bytes(marks)
    return bytes(int(any(marks[i:i + blocks_per_cell]))
                 for i in range(0, len(marks), blocks_per_cell))  # fmt: skip


def _or_all(chunk: bytes) -> int:
    """The OR of a chunk's state bits (over its few distinct values)."""
    m = 0
    for v in set(chunk):
        m |= v
    return m


Run = tuple[int, int]
"""``(first_block, count)``: ``count`` consecutive block ids from ``first_block``."""


def table_runs(block_ids: Sequence[int], runs: list[Run] | None = None,
               start: int = 0) -> list[Run]:
    """The table as runs of consecutive block ids, in order.

    With ``runs`` (the runs of ``block_ids[:start]``), extends them in place with the
    blocks from ``start`` on: a table only grows, so its runs can be kept and extended.
    """
    runs = [] if runs is None else runs
    if runs:
        first, count = runs[-1]
        prev = first + count - 1
    else:
        first, count, prev = -1, 0, -2
    for i in range(start, len(block_ids)):
        b = block_ids[i]
        if b == prev + 1:
            count += 1
            runs[-1] = (first, count)
        else:
            first, count = b, 1
            runs.append((b, 1))
        prev = b
    return runs


def expand_runs(runs: Sequence[Sequence[int]]) -> list[int]:
    """The inverse of :func:`table_runs`."""
    return [b for first, count in runs for b in range(first, first + count)]
