"""The scheduler over a KV block store: loads as waits, and what each step moves."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.engine.core.request import RequestStatus
from tests.helpers.scheduler import BS, FakeRunner, make_request, make_scheduler, run_step


class Ticket:
    def __init__(self, keys: Sequence[bytes], payloads: list[bytes]) -> None:
        self.keys = tuple(keys)
        self._payloads = payloads
        self.finished = False
        self.cancelled = False

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished

    def cancel(self) -> None:
        self.cancelled = True

    def payloads(self) -> list[bytes]:
        return self._payloads


class FakeStore:
    """Blocks by key; every load waits until the test finishes its ticket."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.tickets: list[Ticket] = []

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def request_load(self, keys: Sequence[bytes]) -> Ticket:
        self.tickets.append(Ticket(keys, [self.blocks[k] for k in keys]))
        return self.tickets[-1]


PROMPT = list(range(10, 23))
"""3 full blocks; a lookup may hit 3."""


def save(store: FakeStore, out) -> None:
    for key, _ in out.blocks_to_save:
        store.blocks[key] = b"kv-of-" + key


def stored_prompt(num_blocks: int, **kw):
    """A scheduler over a fake store that holds the blocks of ``PROMPT`` (computed by a
    first request, then handed over by a reset of the pool): ``(store, runner, s)``."""
    store, runner = FakeStore(), FakeRunner()
    s = make_scheduler(num_blocks=num_blocks, kv_store=store, **kw)
    s.add_request(make_request("a", PROMPT, max_tokens=1))
    while s.has_unfinished():
        save(store, run_step(s, runner))
    assert s.kv.reset_prefix_cache()
    for key, _ in s.take_kv_saves():
        store.blocks[key] = b"kv-of-" + key
    return store, runner, s


def test_a_request_waits_for_its_load_then_hits_the_blocks_read() -> None:
    store, runner, s = stored_prompt(8)
    prompt = PROMPT
    assert len(store.blocks) == 3
    b = make_request("b", prompt, max_tokens=3)
    s.add_request(b)
    out = run_step(s, runner)
    assert out.is_empty and b.status is RequestStatus.WAITING_FOR_KV_LOAD
    assert s.num_waiting == 1 and s.has_unfinished()
    assert run_step(s, runner).is_empty  # the load is not done: nothing to step
    store.tickets[-1].finished = True
    out = run_step(s, runner)
    assert out.num_scheduled_tokens == {"b": len(prompt) - 3 * BS}
    table = s.kv.get_block_table("b")
    assert [blk for blk, _ in out.blocks_to_load] == table[:3]
    assert [p for _, p in out.blocks_to_load] == [b"kv-of-" + s.kv.pool.block_hash[x]
                                                 for x in table[:3]]  # fmt: skip
    assert b.num_cached_tokens == 3 * BS
    assert s.store_tier.stats.placed == 3 and s.store_tier.stats.loads == 1
    while s.has_unfinished():
        run_step(s, runner)
    s.kv.check_invariants()


def test_aborting_a_waiting_load_cancels_it() -> None:
    store, runner, s = stored_prompt(8)
    prompt = PROMPT
    b = make_request("b", prompt)
    s.add_request(b)
    run_step(s, runner)
    assert b.status is RequestStatus.WAITING_FOR_KV_LOAD
    b.runner_knows = True  # as after a preemption: the runner holds its state
    s.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert store.tickets[-1].cancelled and not s.has_unfinished()
    assert s.kv.stats().num_used_blocks == 0
    assert "b" in s._finished_ids and not b.runner_knows


def test_write_through_names_the_blocks_a_step_fills() -> None:
    store, runner = FakeStore(), FakeRunner()
    s = make_scheduler(num_blocks=8, kv_store=store, kv_store_write_through=True)
    s.add_request(make_request("a", list(range(10, 23)), max_tokens=3))
    out = run_step(s, runner)
    assert [b for _, b in out.blocks_to_write] == s.kv.get_block_table("a")[:3]
    assert out.blocks_to_save == [] and out.blocks_to_load == []


def test_a_load_cut_short_leaves_the_rest_to_compute() -> None:
    store, runner, s = stored_prompt(8)
    prompt = PROMPT
    b = make_request("b", prompt, max_tokens=3)
    s.add_request(b)
    run_step(s, runner)
    ticket = store.tickets[-1]
    ticket._payloads = ticket._payloads[:1]  # the second block's file was damaged
    ticket.finished = True
    out = run_step(s, runner)
    assert len(out.blocks_to_load) == 1 and b.num_cached_tokens == BS
    assert out.num_scheduled_tokens == {"b": len(prompt) - BS}
    assert s.store_tier.stats.cut_short == 2
    while s.has_unfinished():
        run_step(s, runner)
    s.kv.check_invariants()


def test_requests_of_one_prefix_share_a_load() -> None:
    store, runner, s = stored_prompt(16)
    prompt = PROMPT
    reqs = [make_request(rid, prompt + [90 + i], max_tokens=2) for i, rid in enumerate("bcd")]
    for r in reqs:
        s.add_request(r)
    run_step(s, runner)
    assert len(store.tickets) == 1 and s.store_tier.stats.shared == 2
    s.finish_request(reqs[2], RequestStatus.FINISHED_ABORTED)  # one leaves: the load goes on
    assert not store.tickets[0].cancelled
    store.tickets[0].finished = True
    out = run_step(s, runner)
    assert len(out.blocks_to_load) == 3  # read once, placed once, hit by both
    assert [r.num_cached_tokens for r in reqs[:2]] == [3 * BS, 3 * BS]
    while s.has_unfinished():
        run_step(s, runner)
    s.kv.check_invariants()
