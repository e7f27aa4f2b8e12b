"""Physical block pool: reference counts, the free queue and the prefix-cache map.

Invariants (checked by :mod:`pagedserve.blockmgr.invariants`):

* a block is in the free queue if and only if its ref count is 0;
* ``cached[key] == b`` if and only if ``block_hash[b] == key``; a block has at most one
  key and a key at most one block (the first block registered under it wins, a later
  duplicate stays uncached);
* a cached block keeps its key while free and loses it only when it is taken for new
  use (eviction), or on :meth:`BlockPool.reset_prefix_cache`;
* ``block_meta[b]`` (parent key, token ids, extra keys) is set exactly for cached blocks,
  and hashing it again gives ``block_hash[b]``;
* ``keyed[b]`` is 1 exactly for cached blocks (the block map reads the pool's keys from it
  in one pass of C);
* ``spill[b]`` is 1 only for cached blocks: those handed to ``on_spill`` (the lower tier,
  :mod:`pagedserve.blockmgr.lower_tier`) when they are evicted for reuse or by
  :meth:`BlockPool.reset_prefix_cache`, never when their keys are dropped as untrusted;
* ``loaded[b]`` is 1 only for cached blocks: those whose bytes were read back from the
  lower tier rather than computed (the block map marks them); it goes with the key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedserve.blockmgr.free_list import FreeBlockQueue
from pagedserve.blockmgr.hashing import BlockHash, ExtraKeys

BlockMeta = tuple[BlockHash, list[int], ExtraKeys]
"""What a cached block's key was computed from: (parent key, token ids, extra keys).
The token list is the pool's own copy (a slice taken when the key was computed)."""


class BlockPool:
    """Owns every block's ref count and cache key. Knows nothing about requests."""

    __slots__ = ("num_blocks", "ref_counts", "block_hash", "block_meta", "keyed", "cached",
                 "free_queue", "num_evictions", "spill", "on_spill", "loaded")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_meta: list[BlockMeta | None] = [None] * num_blocks
        self.keyed = bytearray(num_blocks)
        self.cached: dict[BlockHash, int] = {}
        self.free_queue = FreeBlockQueue(num_blocks)
        self.num_evictions = 0
        self.spill = bytearray(num_blocks)
        self.loaded = bytearray(num_blocks)
        self.on_spill: Callable[[BlockHash, int], None] | None = None
        """Called with ``(key, block)`` as a spilling block is evicted, before the block
        is reused (the lower tier's :meth:`~pagedserve.blockmgr.lower_tier.LowerTier.evicted`)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not."""
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the free-queue head with ref count 1, evicting their keys.

        The caller checks ``n <= num_free_blocks`` first.
        """
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, {len(self.free_queue)} free")
        popleft = self.free_queue.popleft
        ref_counts = self.ref_counts
        block_hash = self.block_hash
        out = []
        for _ in range(n):
            b = popleft()
            if block_hash[b] is not None:
                self._evict(b, spill=True)
            ref_counts[b] = 1
            out.append(b)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a free one leaves the free queue."""
        ref_counts = self.ref_counts
        for b in block_ids:
            if ref_counts[b] == 0:
                self.free_queue.remove(b)
            ref_counts[b] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; a block reaching 0 goes
        to the free-queue tail and keeps its key."""
        ref_counts = self.ref_counts
        append = self.free_queue.append
        for b in block_ids:
            rc = ref_counts[b] - 1
            if rc < 0:
                raise AssertionError(f"block {b} released with ref count 0")
            ref_counts[b] = rc
            if rc == 0:
                append(b)

    def cache_block(self, block_id: int, key: BlockHash, meta: BlockMeta,
                    spill: bool = False, loaded: bool = False) -> bool:  # fmt: skip
        """Register ``block_id`` under ``key``; with ``spill`` the block goes to the lower
        tier when it is evicted; ``loaded`` says its bytes come from the lower tier. Returns False (no change) if the key is already taken by
        another block (a duplicate) or the block already has a key."""
        if key in self.cached or self.block_hash[block_id] is not None:
            return False
        self.cached[key] = block_id
        self.block_hash[block_id] = key
        self.block_meta[block_id] = meta
        self.keyed[block_id] = 1
        self.spill[block_id] = spill
        self.loaded[block_id] = loaded
        return True

    def lookup(self, key: BlockHash) -> int | None:
        """The block cached under ``key``, or None."""
        return self.cached.get(key)

    def _evict(self, block_id: int, spill: bool = False) -> None:
        """Forget the block's key; with ``spill`` (its bytes are intact) a spilling block
        goes to ``on_spill`` first."""
        key = self.block_hash[block_id]
        if spill and self.spill[block_id] and self.on_spill is not None:
            self.on_spill(key, block_id)
        self.spill[block_id] = 0
        self.loaded[block_id] = 0
        del self.cached[key]
        self.block_hash[block_id] = None
        self.block_meta[block_id] = None
        self.keyed[block_id] = 0
        self.num_evictions += 1

    def forget_keys(self, block_ids: Iterable[int]) -> int:
        """Forget the keys of those of ``block_ids`` that hold one reference (their one
        holder's alone); returns how many had one."""
        n = 0
        for b in block_ids:
            if self.ref_counts[b] == 1 and self.block_hash[b] is not None:
                self._evict(b)
                n += 1
        return n

    def evict_unreferenced(self) -> int:
        """Forget the keys of all free blocks (ref count 0); returns how many."""
        free = [b for b in self.cached.values() if self.ref_counts[b] == 0]
        for b in free:
            self._evict(b)
        return len(free)

    def reset_prefix_cache(self) -> bool:
        """Forget every key (spilling blocks go to ``on_spill`` first, least recently
        freed first: their bytes are intact). Refused (False, nothing changed) while any
        block is referenced."""
        if len(self.free_queue) != self.num_blocks:
            return False
        if self.on_spill is not None:
            for b in list(self.free_queue):
                if self.spill[b]:
                    self.on_spill(self.block_hash[b], b)
        self.spill = bytearray(self.num_blocks)
        self.loaded = bytearray(self.num_blocks)
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_meta = [None] * self.num_blocks
        self.keyed = bytearray(self.num_blocks)
        return True
