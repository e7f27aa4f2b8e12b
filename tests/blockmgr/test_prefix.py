"""Prefix caching: hits, salts, LRU eviction, reset and counters."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager, hash_block_tokens
from pagedserve.blockmgr.hashing import ROOT_HASH
from tests.helpers.blockmgr import BS, FakeRequest, step


def admit(mgr: KVCacheManager, req: FakeRequest) -> tuple[list[int], int]:
    """Lookup, then allocate the whole rest of the request in one step."""
    blocks, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, len(req.all_token_ids) - n, blocks)
    req.num_computed_tokens = len(req.all_token_ids)
    mgr.check_invariants()
    return blocks, n


def test_hash_is_chained_and_salted() -> None:
    a = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert len(a) == 16
    assert a == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert a != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    assert a != hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], ("s",))
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], ("",)) != a
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(ROOT_HASH, [5, 6, 7, 8])


def test_same_prompt_twice_leaves_last_token() -> None:
    mgr = KVCacheManager(16, BS)
    prompt = list(range(12))  # exactly 3 full blocks
    a = FakeRequest("a", list(prompt))
    assert admit(mgr, a) == ([], 0)
    table_a = list(mgr.get_block_table("a"))
    b = FakeRequest("b", list(prompt))
    blocks, n = admit(mgr, b)
    assert (blocks, n) == (table_a[:2], 8)  # the third block holds the last token
    assert mgr.get_block_table("b")[:2] == table_a[:2]
    assert mgr.get_block_table("b")[2] != table_a[2]
    assert [mgr.pool.ref_counts[x] for x in table_a] == [2, 2, 1]
    c = FakeRequest("c", prompt + [99])  # one more token: all 3 blocks hit
    assert admit(mgr, c) == (table_a, 12)


def test_prefix_ending_mid_block_hits_full_blocks_only() -> None:
    mgr = KVCacheManager(16, BS)
    a = FakeRequest("a", list(range(20)))
    admit(mgr, a)
    b = FakeRequest("b", list(range(10)) + [500, 501, 502])  # shares 10 tokens
    blocks, n = admit(mgr, b)
    assert n == 8 and blocks == mgr.get_block_table("a")[:2]


def test_different_salt_never_shares() -> None:
    mgr = KVCacheManager(32, BS)
    prompt = list(range(13))
    admit(mgr, FakeRequest("a", list(prompt), cache_salt="alice"))
    assert admit(mgr, FakeRequest("b", list(prompt), cache_salt="bob")) == ([], 0)
    assert admit(mgr, FakeRequest("c", list(prompt))) == ([], 0)
    assert admit(mgr, FakeRequest("d", list(prompt), cache_salt="alice"))[1] == 12


def test_generated_tokens_are_cached_as_blocks_fill() -> None:
    mgr = KVCacheManager(16, BS)
    a = FakeRequest("a", [1, 2, 3])
    admit(mgr, a)
    for t in range(4, 12):  # decode
        a.all_token_ids.append(t)
        assert step(mgr, a, 1)
        mgr.check_invariants()
    # Block 1 ([5..8]) is full and cached, even though it holds generated tokens.
    assert len(mgr.pool.cached) == 2
    b = FakeRequest("b", list(range(1, 12)) + [7])
    assert admit(mgr, b)[1] == 8


def test_same_step_hit_and_duplicates() -> None:
    mgr = KVCacheManager(16, BS)
    a = FakeRequest("a", list(range(9)))
    b = FakeRequest("b", list(range(9)))
    # Both look up before either allocates: both miss, both compute the same blocks.
    assert mgr.get_computed_blocks(a) == ([], 0)
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert mgr.allocate_slots(a, 9)
    assert mgr.allocate_slots(b, 9)
    mgr.check_invariants()
    assert len(mgr.pool.cached) == 2  # b's duplicates are not cached
    assert set(mgr.pool.cached.values()) == set(mgr.get_block_table("a")[:2])
    # A third request in the same step hits blocks a registered at allocation.
    c = FakeRequest("c", list(range(9)))
    assert admit(mgr, c)[0] == mgr.get_block_table("a")[:2]
    # Freeing a: its blocks stay cached (c holds them); b's duplicates still uncached.
    mgr.free(a)
    mgr.free(c)
    mgr.check_invariants()
    assert len(mgr.pool.cached) == 2


def test_freed_blocks_stay_hittable_until_reused_lru() -> None:
    mgr = KVCacheManager(4, BS)
    a = FakeRequest("a", list(range(13)))  # 4 blocks, 3 full and cached
    admit(mgr, a)
    table = list(mgr.get_block_table("a"))
    mgr.free(a)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 4
    assert len(mgr.pool.cached) == 3
    # Still hittable while free; a hit revives free blocks out of the middle of the queue.
    b = FakeRequest("b", list(range(13)))
    assert admit(mgr, b) == (table[:3], 12)
    mgr.free(b)
    # Tail first: the queue reads tail-block .. head-block, so the tail of the prefix is
    # evicted first. A new 1-block request evicts only the prefix's last block.
    assert list(mgr.pool.free_queue)[:2] == [table[3], table[2]]
    x = FakeRequest("x", [900, 901])
    admit(mgr, x)  # takes table[3] (uncached partial block)
    assert len(mgr.pool.cached) == 3
    y = FakeRequest("y", [800, 801])
    admit(mgr, y)  # takes table[2]: evicts the prefix's third block
    assert len(mgr.pool.cached) == 2
    assert mgr.pool.num_evictions == 1
    c = FakeRequest("c", list(range(13)))
    assert mgr.get_computed_blocks(c) == (table[:2], 8)


def test_an_untrusted_requests_own_blocks_leave_the_cache_shared_ones_stay() -> None:
    mgr = KVCacheManager(16, BS)
    a = FakeRequest("a", list(range(9)))  # 2 full blocks cached
    admit(mgr, a)
    b = FakeRequest("b", list(range(4)) + [70, 71, 72, 73, 74])  # shares a's first block
    assert admit(mgr, b)[1] == 4
    table_a, table_b = list(mgr.get_block_table("a")), list(mgr.get_block_table("b"))
    assert len(mgr.pool.cached) == 3
    mgr.free(b, keep_cached=False)  # b's KV is not trusted: its own full block goes
    mgr.check_invariants()
    assert mgr.num_free_blocks == 16 - 3
    assert sorted(mgr.pool.cached.values()) == sorted(table_a[:2])
    assert mgr.get_computed_blocks(FakeRequest("c", list(b.all_token_ids))) == (table_b[:1], 4)
    mgr.free(a, keep_cached=False)  # now the shared block is a's alone: it goes too
    mgr.check_invariants()
    assert mgr.num_free_blocks == 16 and not mgr.pool.cached
    assert mgr.get_computed_blocks(FakeRequest("d", list(range(9)))) == ([], 0)


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(8, BS)
    a = FakeRequest("a", list(range(9)))
    admit(mgr, a)
    assert not mgr.reset_prefix_cache()  # a holds blocks
    assert len(mgr.pool.cached) == 2
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    mgr.check_invariants()
    assert mgr.stats().num_cached_blocks == 0
    assert mgr.get_computed_blocks(FakeRequest("b", list(range(9)))) == ([], 0)


def test_hit_counters() -> None:
    mgr = KVCacheManager(16, BS)
    admit(mgr, FakeRequest("a", list(range(10))))
    admit(mgr, FakeRequest("b", list(range(10))))
    admit(mgr, FakeRequest("c", list(range(100, 105))))
    s = mgr.stats()
    assert s.prefix_cache_queries == 25
    assert s.prefix_cache_hits == 8
    assert s.hit_rate == pytest.approx(8 / 25)


def test_caching_off() -> None:
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    admit(mgr, FakeRequest("a", list(range(9))))
    assert admit(mgr, FakeRequest("b", list(range(9)))) == ([], 0)
    assert not mgr.pool.cached
    assert mgr.stats().prefix_cache_queries == 0


def test_stale_computed_blocks_are_rejected() -> None:
    mgr = KVCacheManager(4, BS)
    a = FakeRequest("a", list(range(9)))
    admit(mgr, a)
    mgr.free(a)
    b = FakeRequest("b", list(range(9)))
    blocks, n = mgr.get_computed_blocks(b)
    assert n == 8  # two cached, free blocks
    # Another request takes every block, evicting what b looked up and caching its own
    # tokens in those blocks; then it frees them.
    x = FakeRequest("x", [7] * 16)
    admit(mgr, x)
    mgr.free(x)
    with pytest.raises(ValueError, match="no longer cached"):
        mgr.allocate_slots(b, 1, blocks)
    mgr.check_invariants()


def test_not_enough_blocks_with_hit_changes_nothing() -> None:
    mgr = KVCacheManager(4, BS)
    a = FakeRequest("a", list(range(9)))
    admit(mgr, a)
    mgr.free(a)
    hold = FakeRequest("h", [5] * 4)
    admit(mgr, hold)  # takes the uncached third block
    b = FakeRequest("b", list(range(9)) + list(range(50, 60)))  # 2 hit + needs 3 new
    blocks, n = mgr.get_computed_blocks(b)
    assert n == 8
    before = (list(mgr.pool.free_queue), list(mgr.pool.ref_counts), dict(mgr.pool.cached))
    assert not mgr.allocate_slots(b, len(b.all_token_ids) - n, blocks)
    assert (list(mgr.pool.free_queue), list(mgr.pool.ref_counts), dict(mgr.pool.cached)) == before
    assert mgr.num_allocated_blocks("b") == 0
    mgr.check_invariants()


def test_packing_matches_array_bytes() -> None:
    from array import array

    from pagedserve.blockmgr.hashing import pack_token_ids

    tokens = [0, 1, 2**40, 151_935, 7]
    assert pack_token_ids(tokens) == array("q", tokens).tobytes()
