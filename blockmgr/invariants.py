"""Consistency checks of a KVCacheManager (O(total blocks); for tests and debugging).

:func:`check_manager` reads the manager through :class:`ManagerState` (what it looks
at), so this module does not import the manager, which calls it.

Checked:

1. free + used == total, and the free queue's links are sound;
2. a block is in the free queue iff its ref count is 0 (never free and referenced);
3. each ref count equals the number of live block tables holding the block, and no table
   holds a block twice;
4. the cache map and the per-block keys mirror each other; every cached block's stored
   (parent key, tokens, extra keys) hash to its key, with exactly ``block_size`` tokens;
5. each table's hashed blocks, if cached, are cached under the table's own chain keys, and
   a table has exactly ``ceil(num_tokens / block_size)`` blocks;
6. the slot counters equal their sums over live requests; nothing is cached with caching off;
7. with several KV groups: every group's table has group 0's length; the null block
   (one past the pool) fills exactly the first ``num_skipped`` positions of a sliding
   group's table and no other position of any table; a cached block's key names its
   group, and a table's blocks are cached only under their own group's keys;
8. only cached blocks are marked to spill into the lower tier.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from pagedserve.blockmgr.block_pool import BlockPool
from pagedserve.blockmgr.hashing import group_key, hash_block_tokens, split_group_key
from pagedserve.blockmgr.request_state import RequestBlocks
from pagedserve.blockmgr.util import cdiv


class ManagerState(Protocol):
    """The state of a :class:`blockmgr.KVCacheManager` the checks read."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    pool: BlockPool
    requests: dict[str, RequestBlocks]
    windows: tuple[int | None, ...]
    null_block: int
    num_slots_allocated: int
    num_slots_filled: int


def check_manager(mgr: ManagerState) -> None:
    """Raise AssertionError with a message naming the first broken invariant."""
    pool = mgr.pool
    n = mgr.num_blocks
    assert len(pool.ref_counts) == n, (
        f"ref_counts has {len(pool.ref_counts)} entries for {n} blocks")
    _check_free_queue(pool, n)
    _check_holders(mgr)
    _check_cache(mgr)
    _check_tables(mgr)


def _check_free_queue(pool: BlockPool, n: int) -> None:
    """1, 2: free queue vs ref counts."""
    ref_counts = pool.ref_counts
    free = pool.free_queue.check()
    free_set = set(free)
    assert len(free_set) == len(free), "free list holds a block twice"
    num_used = sum(1 for rc in ref_counts if rc > 0)
    assert len(free) + num_used == n, (
        f"free ({len(free)}) + used ({num_used}) != total ({n})")
    for b, rc in enumerate(ref_counts):
        assert rc >= 0, f"block {b} has negative ref count {rc}"
        assert (rc == 0) == (b in free_set), (
            f"block {b}: ref count {rc} but {'in' if b in free_set else 'not in'} the free list")


def _check_holders(mgr: ManagerState) -> None:
    """3: ref counts vs tables."""
    holders: Counter[int] = Counter()
    null = mgr.null_block
    for rid, state in mgr.requests.items():
        blocks = [b for st in state.groups() for b in st.block_ids if b != null]
        assert len(set(blocks)) == len(blocks), f"request {rid}: a block appears twice in {blocks}"
        assert all(0 <= b < mgr.num_blocks for b in blocks), (
            f"request {rid}: a block id outside the pool in {blocks}")
        holders.update(blocks)
    for b, rc in enumerate(mgr.pool.ref_counts):
        assert rc == holders[b], f"block {b}: ref count {rc} but held by {holders[b]} tables"


def _check_cache(mgr: ManagerState) -> None:
    """4: cache map vs per-block keys and contents."""
    pool, bs = mgr.pool, mgr.block_size
    num_keyed = 0
    for b in range(mgr.num_blocks):
        key = pool.block_hash[b]
        meta = pool.block_meta[b]
        assert pool.keyed[b] == (key is not None), f"block {b}: keyed flag {pool.keyed[b]}"
        assert not pool.spill[b] or key is not None, f"block {b} spills but has no key"
        assert not pool.loaded[b] or key is not None, f"block {b} is marked loaded but has no key"
        assert not (pool.loaded[b] and pool.spill[b]), f"block {b} was loaded and spills"
        if key is None:
            assert meta is None, f"block {b} has cache metadata but no key"
            continue
        num_keyed += 1
        assert pool.cached.get(key) == b, f"block {b} has a key that maps to {pool.cached.get(key)}"
        assert meta is not None, f"cached block {b} has no metadata"
        parent, tokens, extras = meta
        assert len(tokens) == bs, f"cached block {b} holds {len(tokens)} tokens, not {bs}"
        chain_key, group = split_group_key(key)
        assert group < len(mgr.windows), f"cached block {b}: key of group {group}"
        assert hash_block_tokens(parent, tokens, extras) == chain_key, (
            f"cached block {b}: key does not match its parent, tokens and extra keys")
    assert num_keyed == len(pool.cached), (
        f"{len(pool.cached)} cache entries but {num_keyed} blocks with a key")
    for key, b in pool.cached.items():
        assert pool.block_hash[b] == key, f"cache entry for block {b} does not match its key"
    if not mgr.enable_prefix_caching:
        assert not pool.cached, "blocks are cached with prefix caching off"


def _check_tables(mgr: ManagerState) -> None:
    """5, 6, 7: per-request tables and slot counters."""
    pool, bs, null = mgr.pool, mgr.block_size, mgr.null_block
    allocated = filled = 0
    for rid, state in mgr.requests.items():
        blocks = state.block_ids
        h = state.num_hashed_blocks
        assert h <= len(blocks) and h <= len(state.block_hashes), (
            f"request {rid}: {h} hashed blocks, {len(blocks)} blocks, "
            f"{len(state.block_hashes)} keys")
        assert len(blocks) == cdiv(state.num_tokens, bs), (
            f"request {rid}: {len(blocks)} blocks for {state.num_tokens} tokens")
        groups = state.groups()
        assert len(groups) == len(mgr.windows), (
            f"request {rid}: {len(groups)} tables for {len(mgr.windows)} KV groups")
        for g, st in enumerate(groups):
            ids = st.block_ids
            assert len(ids) == len(blocks), (
                f"request {rid}: group {g}'s table has {len(ids)} positions, group 0's "
                f"{len(blocks)}")
            k = st.num_skipped
            assert k == 0 or mgr.windows[g] is not None, (
                f"request {rid}: full-attention group {g} skips {k} positions")
            assert all(b == null for b in ids[:k]) and null not in ids[k:], (
                f"request {rid}: group {g}'s table {ids} does not hold the null block at "
                f"exactly its first {k} positions")
            for i in range(h):
                b = ids[i]
                key = None if b == null else pool.block_hash[b]
                assert key is None or key == group_key(state.block_hashes[i], g), (
                    f"request {rid}: block {b} at position {i} of group {g} is cached under "
                    "another chain or group")
            allocated += (len(ids) - k) * bs
            filled += state.num_tokens - k * bs
    assert allocated == mgr.num_slots_allocated, (
        f"num_slots_allocated={mgr.num_slots_allocated}, tables hold {allocated}")
    assert filled == mgr.num_slots_filled, (
        f"num_slots_filled={mgr.num_slots_filled}, tables ask for {filled}")
