"""Block manager: allocation, freeing, fork, stats and the invariant checker."""

from __future__ import annotations

import logging
import sys

import pytest

from pagedserve.blockmgr import KVCacheManager
from tests.helpers.blockmgr import BS, FakeRequest, step


def test_no_torch_or_numpy_import() -> None:
    import pagedserve.blockmgr  # noqa: F401

    assert "pagedserve.blockmgr" in sys.modules
    src = [m for m in sys.modules if m.startswith("pagedserve.blockmgr")]
    for name in src:
        mod = sys.modules[name]
        text = open(mod.__file__).read() if getattr(mod, "__file__", None) else ""
        assert "import torch" not in text and "import numpy" not in text, name


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(0, BS)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)


def test_allocation_grows_one_block_at_a_time() -> None:
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    req = FakeRequest("a", list(range(3)))
    assert step(mgr, req, 3)
    table = mgr.get_block_table("a")
    assert table == [0]
    for t in range(3, 13):  # decode one token at a time
        req.all_token_ids.append(t)
        assert step(mgr, req, 1)
        assert mgr.num_allocated_blocks("a") == -(-(t + 1) // BS)
        mgr.check_invariants()
    assert mgr.get_block_table("a") is table  # the same list, grown in place
    assert table == [0, 1, 2, 3]
    assert mgr.num_free_blocks == 4
    assert mgr.usage == pytest.approx(0.5)


def test_all_or_nothing_when_blocks_run_out() -> None:
    mgr = KVCacheManager(4, BS, enable_prefix_caching=False)
    a = FakeRequest("a", list(range(9)))
    assert step(mgr, a, 9)  # 3 blocks
    b = FakeRequest("b", list(range(8)))
    before = (mgr.num_free_blocks, mgr.stats(), list(mgr.get_block_table("a")))
    assert not mgr.allocate_slots(b, 8)  # needs 2, 1 free
    assert (mgr.num_free_blocks, mgr.stats(), mgr.get_block_table("a")) == before
    assert mgr.num_allocated_blocks("b") == 0
    assert mgr.get_block_table("b") == []
    mgr.check_invariants()
    assert mgr.allocate_slots(b, 4)
    assert mgr.num_free_blocks == 0
    assert not mgr.allocate_slots(b, 5)
    mgr.check_invariants()


def test_free_returns_everything_tail_first() -> None:
    mgr = KVCacheManager(6, BS, enable_prefix_caching=False)
    a = FakeRequest("a", list(range(10)))
    b = FakeRequest("b", list(range(5)))
    assert step(mgr, a, 10) and step(mgr, b, 5)
    assert mgr.get_block_table("a") == [0, 1, 2]
    mgr.free(a)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 4
    mgr.free(b)
    mgr.free(b)  # unknown request: no-op
    mgr.check_invariants()
    assert mgr.num_free_blocks == 6 and mgr.usage == 0.0
    # Free queue order: never-used 5, then a's blocks tail first, then b's.
    assert list(mgr.pool.free_queue) == [5, 2, 1, 0, 4, 3]


def test_fork_shares_full_blocks() -> None:
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent = FakeRequest("p", list(range(10)))
    assert step(mgr, parent, 10)
    child = FakeRequest("c", list(range(10)))
    assert mgr.fork(parent, child, 9) == 8
    shared = mgr.get_block_table("p")[:2]
    assert mgr.get_block_table("c") == shared
    assert all(mgr.pool.ref_counts[b] == 2 for b in shared)
    mgr.check_invariants()
    child.num_computed_tokens = 8
    assert step(mgr, child, 2)
    assert mgr.get_block_table("c")[:2] == shared
    assert mgr.get_block_table("c")[2] not in mgr.get_block_table("p")
    mgr.free(parent)
    assert all(mgr.pool.ref_counts[b] == 1 for b in shared)
    mgr.check_invariants()
    mgr.free(child)
    assert mgr.num_free_blocks == 8
    mgr.check_invariants()
    assert step(mgr, parent, 4)
    with pytest.raises(ValueError, match="already has blocks"):
        mgr.fork(child, parent, 4)  # the target has blocks


def test_fork_limits() -> None:
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent = FakeRequest("p", list(range(6)))
    assert mgr.fork(parent, FakeRequest("x"), 8) == 0  # parent has no blocks
    assert step(mgr, parent, 6)
    assert mgr.fork(parent, FakeRequest("c"), 3) == 0  # less than a block
    assert mgr.fork(parent, FakeRequest("d"), 100) == 4  # clamped to the parent's tokens
    mgr.check_invariants()


def test_waste_stats() -> None:
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    assert mgr.stats().waste == 0.0
    a = FakeRequest("a", list(range(5)))
    assert step(mgr, a, 5)
    s = mgr.stats()
    assert (s.num_slots_allocated, s.num_slots_filled) == (8, 5)
    assert s.waste == pytest.approx(3 / 8)
    assert (s.num_blocks, s.num_free_blocks, s.num_used_blocks) == (8, 6, 2)
    assert s.usage == pytest.approx(0.25)
    b = FakeRequest("b", list(range(4)))
    assert step(mgr, b, 4)
    s = mgr.stats()
    assert (s.num_slots_allocated, s.num_slots_filled) == (12, 9)
    mgr.free(a)
    s = mgr.stats()
    assert (s.num_slots_allocated, s.num_slots_filled, s.waste) == (4, 4, 0.0)
    mgr.free(b)
    assert mgr.stats().waste == 0.0


def test_debug_logging(caplog: pytest.LogCaptureFixture) -> None:
    mgr = KVCacheManager(4, BS)
    req = FakeRequest("r", list(range(6)))
    with caplog.at_level(logging.DEBUG, logger="pagedserve.blockmgr"):
        assert step(mgr, req, 6)
        mgr.free(req)
    text = caplog.text
    assert "allocate r" in text and "[0, 1]" in text
    assert "free r" in text and "[1, 0]" in text


# -- the checker itself must catch corruption ------------------------------------------
def _busy_manager() -> tuple[KVCacheManager, FakeRequest, FakeRequest]:
    mgr = KVCacheManager(8, BS)
    a = FakeRequest("a", list(range(10)))
    b = FakeRequest("b", list(range(10)))
    assert step(mgr, a, 10)
    blocks, n = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 10 - n, blocks)
    mgr.check_invariants()
    return mgr, a, b


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda m: m.pool.ref_counts.__setitem__(0, 1), "ref count"),
        (lambda m: m.pool.ref_counts.__setitem__(7, 1), "free .* used"),
        (lambda m: m.pool.free_queue.remove(7), "free"),
        (lambda m: m.requests["a"].block_ids.append(m.requests["a"].block_ids[0]), "twice"),
        (lambda m: m.pool.cached.pop(m.pool.block_hash[0]), "maps to None"),
        (lambda m: m.pool.block_meta.__setitem__(
            0, (m.pool.block_meta[0][0], [9, 9, 9, 9], ())), "key does not match"),
        (lambda m: m.pool.cached.__setitem__(b"\x01" * 16, 5), "cache entries"),
        (lambda m: m.requests["b"].block_hashes.__setitem__(0, b"\x02" * 16), "another chain"),
        (lambda m: setattr(m, "num_slots_filled", 1), "num_slots_filled"),
    ],
)
def test_check_invariants_catches_corruption(corrupt, message: str) -> None:
    mgr, _, _ = _busy_manager()
    corrupt(mgr)
    with pytest.raises(AssertionError, match=message):
        mgr.check_invariants()
