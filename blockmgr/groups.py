"""KV cache groups: layers that share one block table.

A model whose layers all attend to the whole context has one group: every layer reads
the same table. A model with sliding-window layers (Gemma 2/3, Mistral v0.1, Phi-3)
splits its layers into groups of equal size, each group all sliding (with one window) or
all full. Every group gets its own block table over the one shared pool, and a sliding
group's table drops the blocks its window has left behind (they go back to the pool, or
stay in the prefix cache): with Gemma 3's five sliding layers to one full one, a long
request keeps one full table and five tables of about a window each.

Equal sizes make every block the same number of bytes whatever group holds it: a block
id addresses one block of each of ``group_size`` per-position cache tensors, and layer
``j`` of every group reads tensor ``j`` (through its own group's table, so no two groups
ever touch the same block). A type whose layer count is not a multiple of the group size
leaves the last group short; its blocks carry the unused positions.

Positions below a sliding group's window hold the manager's ``null_block`` (the id one
past the pool: the caches keep that block zeroed and no step ever writes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.blockmgr.util import cdiv


@dataclass(frozen=True, slots=True)
class KVGroups:
    """Which layers share a table, and each table's window."""

    windows: tuple[int | None, ...]
    """Per group: the tokens a query sees, its own included (None: the whole context).
    Full groups come first."""
    layers: tuple[tuple[int, ...], ...]
    """Per group: its layers, in order (position ``j`` reads cache tensor ``j``)."""

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVGroups:
        return cls((window,), (tuple(range(num_layers)),))

    @classmethod
    def of_layers(cls, layer_windows: Sequence[int | None]) -> KVGroups:
        """Groups for a model whose layer ``i`` has window ``layer_windows[i]``: one
        group when every layer has the same window; else per window, its layers in runs of
        the group size (the fewest layers any window has)."""
        if not layer_windows:
            return cls((None,), ((),))
        by_window: dict[int | None, list[int]] = {}
        for i, w in enumerate(layer_windows):
            by_window.setdefault(w, []).append(i)
        if len(by_window) == 1:
            (w,) = by_window
            return cls.single(len(layer_windows), w)
        size = min(len(v) for v in by_window.values())
        order = sorted(by_window, key=lambda w: (w is not None, w or 0))
        windows: list[int | None] = []
        layers: list[tuple[int, ...]] = []
        for w in order:
            ids = by_window[w]
            for start in range(0, len(ids), size):
                windows.append(w)
                layers.append(tuple(ids[start:start + size]))
        return cls(tuple(windows), tuple(layers))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Cache tensors a block spans (the layers of the largest group)."""
        return max((len(g) for g in self.layers), default=0)

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    def layer_slots(self, num_layers: int) -> list[tuple[int, int]]:
        """Per layer: ``(group, position)``: the table it reads and its cache tensor."""
        out = [(-1, -1)] * num_layers
        for g, ids in enumerate(self.layers):
            for j, i in enumerate(ids):
                out[i] = (g, j)
        return out

    def peak_blocks(self, block_size: int, num_tokens: int, chunk: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once when its
        prompt is computed in chunks of up to ``chunk`` tokens: a full table of
        ``num_tokens``, and per sliding group its window plus one chunk."""
        full = cdiv(num_tokens, block_size)
        total = 0
        for w in self.windows:
            if w is None:
                total += full
            else:
                total += min(full, cdiv(w - 1 + min(chunk, num_tokens), block_size) + 1)
        return total

    def capacity_tokens(self, block_size: int, num_blocks: int, chunk: int,
                        limit: int) -> int:  # fmt: skip
        """The longest request (at most ``limit`` tokens) whose peak fits ``num_blocks``."""
        if self.peak_blocks(block_size, limit, chunk) <= num_blocks:
            return limit
        lo, hi = 0, limit  # peak_blocks grows with num_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_blocks(block_size, mid, chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo
