"""KV groups: sliding groups keep only their windows; hits need every group."""

from __future__ import annotations

from pagedserve.blockmgr import KVCacheManager
from pagedserve.blockmgr.groups import KVGroups
from tests.helpers.blockmgr import BS, FakeRequest, step


def gemma3_windows(num_layers: int, window: int, pattern: int = 6) -> list[int | None]:
    return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]


def test_groups_of_gemma3_layers():
    g = KVGroups.of_layers(gemma3_windows(26, 512))
    # 4 full layers (5, 11, 17, 23) and 22 sliding: groups of 4, full first, the last short
    assert g.windows == (None, 512, 512, 512, 512, 512, 512)
    assert g.layers[0] == (5, 11, 17, 23)
    assert g.layers[1] == (0, 1, 2, 3) and g.layers[-1] == (24, 25)
    assert g.group_size == 4 and g.sliding
    slots = g.layer_slots(26)
    assert slots[5] == (0, 0) and slots[23] == (0, 3) and slots[25] == (6, 1)
    assert sorted(slots) == sorted({*slots})  # no two layers share a (group, position)
    assert KVGroups.of_layers([None] * 3) == KVGroups.single(3)
    assert KVGroups.of_layers([4096] * 3) == KVGroups((4096,), ((0, 1, 2),))


def test_a_long_request_keeps_one_full_table_and_windows():
    """Gemma 3's five sliding layers to one full: a 400-token request holds its full
    table and about a window per sliding group, under a sixth of a full cache more."""
    window = 16
    groups = KVGroups.of_layers(gemma3_windows(6, window))
    assert groups.num_groups == 6 and groups.group_size == 1
    mgr = KVCacheManager(1000, BS, groups=groups)
    req = FakeRequest("a", list(range(400)))
    for _ in range(0, 400, 32):
        assert step(mgr, req, 32 if req.num_computed_tokens + 32 <= 400 else
                    400 - req.num_computed_tokens)  # fmt: skip
        mgr.check_invariants()
    req.all_token_ids.append(7)
    assert step(mgr, req, 1)
    mgr.check_invariants()
    held = mgr.num_allocated_blocks("a")
    full = 401 // BS + 1
    # the last chunk's reads: the window before it and the chunk itself
    assert held <= full + 5 * ((window + 32) // BS + 1)
    assert held < 0.3 * 6 * full
    assert held == mgr.num_blocks - mgr.num_free_blocks
    tables = mgr.get_block_tables("a")
    assert all(len(t) == len(tables[0]) for t in tables)
    for t in tables[1:]:
        skipped = t.count(mgr.null_block)
        assert t[:skipped] == [mgr.null_block] * skipped
        assert skipped == (400 - window + 1) // BS  # below what token 400 reads
    mgr.free(req)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_blocks and mgr.stats().num_slots_filled == 0


def test_a_hit_counts_only_where_every_sliding_group_holds_its_window():
    window = 6
    groups = KVGroups((None, window), ((1,), (0,)))
    mgr = KVCacheManager(64, BS, groups=groups)
    tokens = list(range(100, 133))  # 8 full blocks and one token
    a = FakeRequest("a", tokens)
    assert step(mgr, a, len(tokens))
    mgr.free(a)  # every block stays cached
    b = FakeRequest("b", list(tokens))
    blocks, n = mgr.get_computed_blocks(b)
    assert n == 32 and len(blocks) == 8
    assert mgr.allocate_slots(b, 1, blocks)
    sliding = mgr.get_block_tables("b")[1]
    first = (32 - window + 1) // BS  # the hit's first token reads from here
    assert sliding[:first] == [mgr.null_block] * first
    assert mgr.null_block not in sliding[first:]
    mgr.check_invariants()
    mgr.free(b)
    # the sliding group's block 7 is taken for other use: a hit of 8 blocks would read it,
    # one of 7 reads blocks 5 and 6 of it, still cached
    b7 = sliding[7]
    mgr.pool.touch([b7])  # taken and its key forgotten, as a new use would
    mgr.pool.forget_keys([b7])
    mgr.pool.release([b7])
    c = FakeRequest("c", list(tokens))
    blocks, n = mgr.get_computed_blocks(c)
    assert n == 28 and len(blocks) == 7
    assert mgr.allocate_slots(c, len(tokens) - n, blocks)
    mgr.check_invariants()


def test_peak_and_capacity_of_a_sliding_model():
    groups = KVGroups((None, 16, 16), ((2,), (0,), (1,)))
    # full table of 1000 tokens + 2 x (window-1 + chunk of 64) tokens of blocks (+1 alignment)
    assert groups.peak_blocks(BS, 1000, 64) == 250 + 2 * (-(-(15 + 64) // BS) + 1)
    assert groups.peak_blocks(BS, 8, 64) == 3 * 2
    cap = groups.capacity_tokens(BS, 300, 64, 10_000)
    assert groups.peak_blocks(BS, cap, 64) <= 300 < groups.peak_blocks(BS, cap + 1, 64)
    assert KVGroups((16,), ((0,),)).capacity_tokens(BS, 30, 64, 10_000) == 10_000
