"""The pool's lower tier: what it is handed at eviction, at keying and on reset, and how
blocks read from it are placed back in the pool."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.blockmgr.groups import KVGroups
from tests.helpers.blockmgr import BS, FakeRequest, step


class FakeTier:
    """Records what the pool hands over; holds the keys it was handed."""

    def __init__(self, write_through: bool = False) -> None:
        self.write_through = write_through
        self.held: set[bytes] = set()
        self.evicted_log: list[tuple[bytes, int]] = []
        self.filled_log: list[tuple[bytes, int]] = []
        self.mgr: KVCacheManager | None = None

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n

    def evicted(self, key: bytes, block_id: int) -> None:
        # Handed over before the block is reused: it still carries its key.
        assert self.mgr is not None and self.mgr.pool.block_hash[block_id] == key
        self.evicted_log.append((key, block_id))
        self.held.add(key)

    def filled(self, key: bytes, block_id: int) -> bool:
        self.filled_log.append((key, block_id))
        if self.write_through:
            self.held.add(key)
        return self.write_through


def manager(num_blocks: int, tier: FakeTier) -> KVCacheManager:
    mgr = KVCacheManager(num_blocks, BS, lower_tier=tier)
    tier.mgr = mgr
    return mgr


def run(mgr: KVCacheManager, req: FakeRequest) -> None:
    """Admit (with the pool's hit), compute the whole prompt, free."""
    computed, n = mgr.get_computed_blocks(req)
    req.num_computed_tokens = 0
    assert mgr.allocate_slots(req, len(req.all_token_ids) - n, computed or None)
    req.num_computed_tokens = len(req.all_token_ids)
    mgr.free(req)


def test_evicted_blocks_are_handed_over_before_reuse_and_only_once() -> None:
    tier = FakeTier()
    mgr = manager(4, tier)
    run(mgr, FakeRequest("a", list(range(12))))  # 3 full blocks, cached and free
    assert tier.filled_log and not tier.evicted_log
    run(mgr, FakeRequest("b", list(range(100, 116))))  # takes all 4: evicts a's 3
    assert len(tier.evicted_log) == 3
    mgr.check_invariants()
    # b's blocks go on reset (their bytes are intact), least recently freed first; a's
    # were handed over already
    lru = [b for b in mgr.pool.free_queue if mgr.pool.spill[b]]
    assert mgr.reset_prefix_cache()
    assert [b for _, b in tier.evicted_log[3:]] == lru
    assert len(tier.evicted_log) == 3 + 4
    assert len({k for k, _ in tier.evicted_log}) == 7
    mgr.check_invariants()


def test_untrusted_blocks_never_reach_the_tier() -> None:
    tier = FakeTier()
    mgr = manager(8, tier)
    req = FakeRequest("a", list(range(12)))
    assert step(mgr, req, 12)
    mgr.free(req, keep_cached=False)  # an errored request
    b = FakeRequest("b", list(range(50, 58)))
    assert step(mgr, b, 8)
    mgr.free(b)
    mgr.drop_unreferenced_cache()  # after a failed step
    assert mgr.reset_prefix_cache()
    assert tier.evicted_log == []
    mgr.check_invariants()


def test_write_through_blocks_are_not_handed_over_again() -> None:
    tier = FakeTier(write_through=True)
    mgr = manager(4, tier)
    run(mgr, FakeRequest("a", list(range(12))))
    run(mgr, FakeRequest("b", list(range(100, 116))))
    assert len(tier.filled_log) == 3 + 4 and tier.evicted_log == []


def test_lora_blocks_stay_in_the_pool() -> None:
    tier = FakeTier()
    mgr = manager(4, tier)
    req = FakeRequest("a", list(range(12)), lora_key="1:ad:/x")
    run(mgr, req)
    run(mgr, FakeRequest("b", list(range(100, 116))))
    assert len(tier.filled_log) == 4  # b's blocks alone
    assert tier.evicted_log == []  # a's blocks were evicted, and not handed over
    tier.held = {k for k, _ in tier.evicted_log} | set(mgr.pool.cached)
    again = FakeRequest("c", list(range(12)), lora_key="1:ad:/x")
    computed, _ = mgr.get_computed_blocks(again)
    assert mgr.lower_tier_keys(again, len(computed)) == []


def test_keys_past_a_hit_and_placing_them_back() -> None:
    tier = FakeTier()
    mgr = manager(8, tier)
    prompt = list(range(21))  # 5 full blocks; a lookup may hit 5 ((21 - 1) // 4)
    run(mgr, FakeRequest("a", prompt))
    held = dict(mgr.pool.cached)
    assert mgr.reset_prefix_cache()
    assert {k for k, _ in tier.evicted_log} == set(held)
    # The pool holds the first block again; the tier all five.
    run(mgr, FakeRequest("b", prompt[:5]))
    req = FakeRequest("c", prompt)
    computed, n = mgr.get_computed_blocks(req)
    assert (len(computed), n) == (1, BS)
    keys = mgr.lower_tier_keys(req, 1)
    assert len(keys) == 4 and all(k in held for k in keys)
    placed = mgr.import_blocks(req, 1, len(keys))
    assert [i for i, _ in placed] == [1, 2, 3, 4]
    assert all(mgr.pool.block_hash[b] == keys[i - 1] for i, b in placed)
    assert all(mgr.pool.ref_counts[b] == 0 and not mgr.pool.spill[b] for _, b in placed)
    # Marked as read back (the block map shows it); the computed first block is not.
    assert [b for b in range(8) if mgr.pool.loaded[b]] == sorted(b for _, b in placed)
    mgr.check_invariants()
    computed, n = mgr.get_computed_blocks(req)
    assert n == 5 * BS and computed[1:] == [b for _, b in placed]
    assert mgr.allocate_slots(req, 1, computed)
    mgr.check_invariants()
    # The mark goes with the key: a reset clears it, and so does reuse.
    req.num_computed_tokens = len(prompt)
    mgr.free(req)
    assert mgr.reset_prefix_cache() and not any(mgr.pool.loaded)
    assert len(mgr.import_blocks(req, 0, 5)) == 5 and mgr.pool.loaded.count(1) == 5
    run(mgr, FakeRequest("d", [100 + i for i in range(8 * BS)]))  # takes every block
    assert not any(mgr.pool.loaded)
    mgr.check_invariants()


def test_placing_takes_at_most_the_free_blocks() -> None:
    tier = FakeTier()
    mgr = manager(3, tier)
    prompt = list(range(21))
    req = FakeRequest("c", prompt)
    placed = mgr.import_blocks(req, 0, 5)
    assert len(placed) == 3 and len({b for _, b in placed}) == 3
    mgr.check_invariants()


def test_placing_never_takes_the_blocks_it_extends() -> None:
    """Placed blocks are taken from the free queue's head, where the pool hit they extend
    may be (a chain's blocks are freed last block first): those are kept out of reach,
    and the chain goes back to the tail with its first block last."""
    tier = FakeTier()
    mgr = manager(8, tier)
    prompt = list(range(21))  # 5 full blocks and one partial
    run(mgr, FakeRequest("a", prompt))
    pool = mgr.pool
    keys = [pool.block_hash[b] for b in range(5)]  # a fresh pool: blocks 0-4 in order
    assert len(keys) == 5
    # Other traffic takes the three uncached blocks and the chain's last three.
    taken = pool.get_new_blocks(6)
    assert len(pool.cached) == 2 and len(tier.held) == 3
    pool.release(taken)
    req = FakeRequest("b", prompt)
    computed, n = mgr.get_computed_blocks(req)
    assert n == 2 * BS
    held = list(computed)
    assert list(pool.free_queue)[:2] == held[::-1]  # the hit is at the head
    placed = mgr.import_blocks(req, 2, 3)
    assert [i for i, _ in placed] == [2, 3, 4]
    assert all(pool.cached.get(k) is not None for k in keys)
    chain = held + [b for _, b in placed]
    assert list(pool.free_queue)[-5:] == chain[::-1]  # the first block evicted last
    mgr.check_invariants()
    computed, n = mgr.get_computed_blocks(req)
    assert n == 5 * BS and computed == chain


def test_a_lower_tier_needs_one_group_and_caching() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(8, BS, enable_prefix_caching=False, lower_tier=FakeTier())
    for windows in ([None, 8], [8, 8]):  # several groups; one sliding group
        with pytest.raises(ValueError):
            KVCacheManager(8, BS, groups=KVGroups.of_layers(windows), lower_tier=FakeTier())
