"""The KV cache snapshot for the block map: exact against the block manager's own tables
over a run with prefix sharing and preemption, compact for a large pool, and taken by the
engine thread between steps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.blockmgr.snapshot import (
    encode_blocks,
    expand_runs,
    summarize,
    summarize_marks,
    table_runs,
)
from pagedserve.engine.core.kv_state import KVState, KVStateTaker, take_kv_state
from pagedserve.engine.core.request import Request, RequestGroup
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput
from pagedserve.engine.loop.llm_engine import EngineStats
from tests.helpers.blockmgr import FakeRequest, step

BS = 4


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    group = RequestGroup(rid, None, list(prompt), sp, 0.0)
    req = Request(rid, group, 0, sp, group.prompt_token_ids, max_tokens)
    group.members.append(req)
    return req


def make_scheduler(num_blocks: int, budget: int, watermark: float = 0.01) -> Scheduler:
    return Scheduler(num_blocks, BS, max_num_seqs=8, max_num_batched_tokens=budget,
                     max_model_len=256, enable_prefix_caching=True, watermark=watermark)


def run_step(s: Scheduler) -> None:
    """One step on a fake model side: each request that caught up samples token 7."""
    out = s.schedule()
    if out.is_empty:
        return
    ids = [rid for rid, n in out.num_scheduled_tokens.items()
           if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens]
    s.update_from_output(out, ModelRunnerOutput(ids, [[7] for _ in ids], [None] * len(ids)))
    s.kv.check_invariants()


def assert_exact(s: Scheduler, st: KVState) -> None:
    """Every byte, table and counter of the snapshot against the manager and scheduler."""
    pool = s.kv.pool
    assert st.blocks_per_cell == 1 and len(st.cells) == s.kv.num_blocks
    for b, cell in enumerate(st.cells):
        assert cell >> 1 == pool.ref_counts[b], f"block {b}"
        assert cell & 1 == (pool.block_hash[b] is not None), f"block {b}"
    live = {rid: r for rid, r in s.requests.items() if not r.status.finished}
    assert [r.request_id for r in st.requests] == \
        [r.request_id for r in (*s.running, *s.waiting)]
    assert {r.request_id for r in st.requests} == set(live)
    for r in st.requests:
        req = live[r.request_id]
        assert expand_runs(r.block_runs) == s.kv.get_block_table(r.request_id)
        assert r.num_blocks == s.kv.num_allocated_blocks(r.request_id)
        assert r.status == req.status.name.lower()
        assert (r.num_tokens, r.num_computed_tokens) == (req.num_tokens, req.num_computed_tokens)
        assert r.num_cached_tokens == max(req.num_cached_tokens, 0)
    used = sum(1 for rc in pool.ref_counts if rc)
    cached_free = sum(1 for b, rc in enumerate(pool.ref_counts)
                      if rc == 0 and pool.block_hash[b] is not None)
    c = st.counters
    assert c["num_used_blocks"] == used
    assert c["num_cached_free_blocks"] == cached_free
    assert c["num_free_blocks"] == s.kv.num_blocks - used - cached_free
    assert c["num_cached_blocks"] == len(pool.cached)
    assert (c["num_running"], c["num_waiting"]) == (s.num_running, s.num_waiting)
    assert c["num_preemptions"] == s.num_preemptions


def test_snapshot_is_exact_through_sharing_and_preemption() -> None:
    # 12 blocks of 4; four requests share an 8-token prefix and grow until the pool runs out.
    s = make_scheduler(num_blocks=12, budget=64, watermark=0.0)
    prefix = list(range(100, 108))
    for i in range(4):
        s.add_request(make_request(f"r{i}", [*prefix, 50 + i], max_tokens=14))
    statuses, max_ref = set(), 0
    taker = KVStateTaker()  # kept across steps: its runs are extended, never recomputed
    for n in range(200):
        st = taker.take(s, float(n))
        assert st == take_kv_state(s, float(n))
        assert_exact(s, st)
        statuses |= {r.status for r in st.requests}
        max_ref = max(max_ref, max(st.cells) >> 1)
        if not s.has_unfinished():
            break
        run_step(s)
    assert s.num_preemptions > 0 and "preempted" in statuses and "running" in statuses
    assert max_ref >= 2  # the shared prefix blocks: ref count 4 while all four ran
    # Drained: nothing in use, the prefix blocks still cached (free but hittable).
    assert st.requests == [] and st.counters["num_used_blocks"] == 0
    assert set(st.cells) <= {0, 1} and st.cells.count(1) == len(s.kv.pool.cached) > 0


def test_cell_byte_encoding() -> None:
    kv = KVCacheManager(8, 4)
    a, b = FakeRequest("a", list(range(9))), FakeRequest("b", list(range(9)))
    assert step(kv, a, 9)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8 and kv.allocate_slots(b, 1, blocks)
    # a: [0, 1, 2], b: [0, 1, 3]; blocks 0 and 1 are full (keyed) and shared.
    assert list(encode_blocks(kv.pool)) == [5, 5, 2, 2, 0, 0, 0, 0]
    kv.free(a)
    kv.free(b)
    assert list(encode_blocks(kv.pool)) == [1, 1, 0, 0, 0, 0, 0, 0]
    kv.pool.ref_counts[5] = 300  # clamped, never an error
    assert encode_blocks(kv.pool)[5] == 254


def test_large_pool_summary_is_a_few_kb() -> None:
    kv = KVCacheManager(100_000, 16)
    reqs = [FakeRequest(f"r{i}", [i] * 16 * 500) for i in range(32)]
    for r in reqs:
        assert step(kv, r, len(r.all_token_ids))  # 32 x 500 blocks, 16,000 in use
    cells, per = summarize(encode_blocks(kv.pool), 2048)
    assert per == 49 and len(cells) == 2041
    runs = [table_runs(kv.get_block_table(r.request_id)) for r in reqs]
    assert all(len(r) == 1 for r in runs)  # fresh pool: each table one run
    # Cells over the first 16,000 blocks are in use, the rest free.
    assert set(cells[:16_000 // per]) == {3} and set(cells[16_000 // per + 1:]) == {0}


def test_summary_cell_is_the_strongest_state() -> None:
    cells, per = summarize(bytearray([0, 1, 0, 0, 0, 2, 1, 1, 0]), 3)
    assert (cells, per) == (bytes([1, 2, 1]), 3)
    # Shared outranks in use, in use outranks cached; the keyed bit is any block's.
    # Ref counts above 2 read as 2; the last cell covers fewer blocks.
    blocks = bytearray([2, 9, 1, 3, 0, 0, 6, 2, 0, 1, 1])
    assert summarize(blocks, 4) == (bytes([5, 3, 4, 1]), 3)
    assert summarize(blocks, 2) == (bytes([5, 5]), 6)  # wide cells: the other path
    assert summarize(blocks, 1) == (bytes([5]), 11)
    with pytest.raises(ValueError, match="max_cells must be positive, got 0"):
        summarize(bytearray(4), 0)


def test_loaded_marks_per_cell() -> None:
    """A cell is marked where any of its blocks holds bytes read back from the store; the
    last cell may cover fewer blocks."""
    marks = bytearray([0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0])
    assert summarize_marks(marks, 1) == bytes(marks)
    assert summarize_marks(marks, 3) == bytes([1, 0, 1, 0])
    assert summarize_marks(marks, 11) == bytes([1])
    assert summarize_marks(bytearray(5), 2) == bytes(3)


def test_table_runs_round_trip() -> None:
    table = [4, 5, 6, 0, 9, 10, 3]
    assert table_runs(table) == [(4, 3), (0, 1), (9, 2), (3, 1)]
    assert expand_runs(table_runs(table)) == table and table_runs([]) == []
    runs = table_runs(table[:2])
    assert table_runs(table, runs, 2) is runs and runs == table_runs(table)


class _FakeEngine:
    """An ``LLMEngine`` stand-in: a real scheduler and the fake model side."""

    def __init__(self) -> None:
        self.scheduler = make_scheduler(num_blocks=16, budget=8)
        self.in_step = False
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.finished_by_reason: dict[str, int] = {}

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(s.num_running, s.num_waiting, s.kv.usage, s.num_preemptions, 0, 0)

    def add_request(self, rid, prompt_token_ids, params, **kw) -> None:
        self.scheduler.add_request(make_request(rid, prompt_token_ids, params.max_tokens))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list:
        self.in_step = True
        run_step(self.scheduler)
        self.in_step = False
        return []


def test_async_engine_takes_it_between_steps_on_its_thread(monkeypatch) -> None:
    import pagedserve.engine.loop.async_engine as mod

    eng = _FakeEngine()
    seen = []

    real_take = KVStateTaker.take

    def spy(self, sched, *args):
        seen.append((threading.current_thread().name, eng.in_step))
        return real_take(self, sched, *args)

    monkeypatch.setattr(mod.KVStateTaker, "take", spy)

    async def main() -> list[KVState]:
        ae = mod.AsyncEngine(eng)
        ae.start(asyncio.get_running_loop())
        try:
            states = [await asyncio.wait_for(ae.kv_state(), 5)]
            ae.add_request("a", list(range(12)), SamplingParams(max_tokens=40),
                           asyncio.Queue())
            for _ in range(2000):
                together = await asyncio.wait_for(
                    asyncio.gather(*(ae.kv_state() for _ in range(3))), 5)
                assert together[0] is together[1] is together[2]  # one snapshot
                states.append(together[0])
                if not together[0].requests:
                    return states
            raise AssertionError("the request did not finish")
        finally:
            ae.shutdown()

    states = asyncio.run(main())
    assert states[0].requests == [] and states[0].counters["num_used_blocks"] == 0
    assert seen and all(name == "engine" and not in_step for name, in_step in seen)
    running = [st for st in states if st.requests and st.requests[0].status == "running"]
    assert running and all(st.requests[0].num_blocks > 0 for st in running)
    assert states[-1].counters["num_used_blocks"] == 0
