"""A compact picture of the block pool: one byte per block, block tables as runs.

Each block's byte is ``min(ref_count, 127) << 1 | cached``: ``0`` free, ``1`` free but
holding a prefix-cache key (hittable until reused), ``>= 2`` in use (``ref_count``
requests hold it; ``>= 4`` shared), the low bit set when it is keyed in the prefix cache.
A pool larger than the picture asked for is summarized: each cell covers
``blocks_per_cell`` consecutive blocks and holds the largest byte among them (an in-use
block outranks a cached one, a cached one a free one).

A block table becomes a list of ``[first_block, count]`` runs of consecutive ids, so the
tables of a fresh pool cost a few numbers each.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockmgr.block_pool import BlockPool
from blockmgr.util import cdiv

MAX_REF_COUNT = 127
"""Ref counts above this are reported as this (the byte has 7 bits for them)."""

_DOUBLE = bytes(min(v, MAX_REF_COUNT) << 1 for v in range(256))
"""``bytes.translate`` table: a ref count byte -> its clamped, shifted state byte."""


def encode_blocks(pool: BlockPool) -> bytearray:
    """One byte per block, in block-id order (see the module docstring)."""
    try:
        counts = bytearray(pool.ref_counts)
    except ValueError:  # a ref count over 255
        counts = bytearray(min(r, MAX_REF_COUNT) for r in pool.ref_counts)
    out = counts.translate(_DOUBLE)
    for b in pool.cached.values():
        out[b] |= 1
    return out


def summarize(cells: bytearray, max_cells: int) -> tuple[bytes, int]:
    """``(cells, blocks_per_cell)``: at most ``max_cells`` cells, each the largest byte of
    its ``blocks_per_cell`` blocks (the last cell may cover fewer)."""
    if max_cells <= 0:
        raise ValueError(f"max_cells must be positive, got {max_cells}")
    n = len(cells)
    if n <= max_cells:
        return bytes(cells), 1
    per = cdiv(n, max_cells)
    return bytes(max(cells[i:i + per]) for i in range(0, n, per)), per


def table_runs(block_ids: Sequence[int]) -> list[list[int]]:
    """``[[first, count], ...]``: the table as runs of consecutive block ids, in order."""
    runs: list[list[int]] = []
    prev = -2
    for b in block_ids:
        if b == prev + 1:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
        prev = b
    return runs


def expand_runs(runs: Sequence[Sequence[int]]) -> list[int]:
    """The inverse of :func:`table_runs`."""
    return [b for first, count in runs for b in range(first, first + count)]
