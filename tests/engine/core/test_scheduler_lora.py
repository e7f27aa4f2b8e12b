"""``max_loras``: a step holds requests of at most that many adapters (and any number of
base-model requests); a request of a further adapter waits, and the requests behind it go
first; under ``priority`` an urgent request of another adapter takes the place of an
adapter whose running requests are all less urgent. Nothing stalls."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine.lora import LoRARequest
from tests.helpers.scheduler import FakeRunner, make_request, make_scheduler, run_step

ADAPTERS = {k: LoRARequest(k, i, f"/adapters/{k}") for i, k in enumerate("ABCD", start=1)}


def _req(rid: str, adapter: str | None, priority: int = 0, prompt_len: int = 4,
         max_tokens: int = 4):  # fmt: skip
    first = 100 + sum(map(ord, rid)) * 7  # no shared blocks between requests
    req = make_request(rid, [first, *range(10, 9 + prompt_len)], max_tokens=max_tokens,
                       priority=priority)
    req.lora_request = None if adapter is None else ADAPTERS[adapter]
    return req


def _adapters_of(s, out) -> set[int]:
    return {s.requests[rid].lora_int_id for rid in out.num_scheduled_tokens
            if rid in s.requests} - {0}  # fmt: skip


def _drain(s, runner, limit: int, max_steps: int = 500) -> list[list[str]]:
    """Run to the end; the requests admitted per step. Every step holds at most
    ``limit`` adapters."""
    admitted = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return admitted
        out = run_step(s, runner)
        assert len(_adapters_of(s, out)) <= limit
        admitted.append([n.req_id for n in out.new_requests])
    raise AssertionError("the requests did not finish")


def test_a_further_adapter_waits_and_the_requests_behind_it_go_first():
    s, runner = make_scheduler(max_num_seqs=8, budget=64, max_loras=1), FakeRunner()
    for rid, adapter in (("a1", "A"), ("b1", "B"), ("a2", "A"), ("base", None), ("c1", "C")):
        s.add_request(_req(rid, adapter, max_tokens=3))
    admitted = _drain(s, runner, limit=1)
    assert admitted[0] == ["a1", "a2", "base"]  # b1 and c1 wait for A's place
    later = [rid for step in admitted[1:] for rid in step]
    assert later == ["b1", "c1"]
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_two_places_hold_two_adapters():
    s, runner = make_scheduler(max_num_seqs=8, budget=64, max_loras=2), FakeRunner()
    for rid, adapter in (("a", "A"), ("b", "B"), ("c", "C"), ("b2", "B")):
        s.add_request(_req(rid, adapter, max_tokens=3))
    admitted = _drain(s, runner, limit=2)
    assert admitted[0] == ["a", "b", "b2"]


def test_an_urgent_adapter_takes_the_place_of_less_urgent_ones():
    s, runner = make_scheduler(max_num_seqs=2, budget=64, max_loras=1,
                               scheduling_policy="priority"), FakeRunner()  # fmt: skip
    s.add_request(_req("a1", "A", priority=5, max_tokens=20))
    s.add_request(_req("a2", "A", priority=5, max_tokens=20))
    run_step(s, runner)
    s.add_request(_req("b", "B", priority=0, max_tokens=3))
    out = run_step(s, runner)
    # Both of A's requests leave: B's request needs the adapter place, not only a seat.
    assert sorted(out.preempted_req_ids) == ["a1", "a2"]
    assert [n.req_id for n in out.new_requests] == ["b"]
    _drain(s, runner, limit=1)  # a1 and a2 come back once b is done, and finish
    assert s.num_preemptions == 2  # taken once, not again every step


def test_no_place_is_taken_from_an_adapter_as_urgent():
    s, runner = make_scheduler(max_num_seqs=4, budget=64, max_loras=1,
                               scheduling_policy="priority"), FakeRunner()  # fmt: skip
    s.add_request(_req("a1", "A", priority=0, max_tokens=6))
    s.add_request(_req("a2", "A", priority=3, max_tokens=6))
    run_step(s, runner)
    s.add_request(_req("b", "B", priority=1, max_tokens=3))
    admitted = _drain(s, runner, limit=1)
    assert s.num_preemptions == 0  # a1 is as urgent as b, or more
    assert ["b"] in admitted


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_waiting_adapter_gets_a_place_under_steady_traffic(policy):
    """One request of adapter B behind a steady stream of A's: B waits while A's
    requests go first, but no longer than LORA_WAIT_STEPS steps; then only base-model
    requests are admitted beside A's running ones until one frees its place for B."""
    from pagedserve.engine.core.lora_slots import LORA_WAIT_STEPS

    s, runner = make_scheduler(max_num_seqs=16, budget=256, max_loras=1,
                               scheduling_policy=policy), FakeRunner()  # fmt: skip
    s.add_request(_req("a0", "A", max_tokens=4))
    s.add_request(_req("b", "B", max_tokens=2))
    admitted_at: dict[str, int] = {}
    for step in range(200):
        for rid, adapter in ((f"a{step + 1}", "A"), (f"base{step}", None)):
            s.add_request(_req(rid, adapter, max_tokens=4))
        out = run_step(s, runner)
        assert len(_adapters_of(s, out)) <= 1, step
        admitted_at.update((n.req_id, step) for n in out.new_requests)
        if "b" in admitted_at and step > admitted_at["b"] + 8:
            break
    b = admitted_at["b"]
    # b is first in line from step 1 (a0 is admitted in step 0): A's requests go first
    # for LORA_WAIT_STEPS steps, then only base requests, until A's running ones finish.
    assert LORA_WAIT_STEPS < b <= LORA_WAIT_STEPS + 6, b
    admitted_a = [step for rid, step in admitted_at.items() if rid.startswith("a")]
    assert max(s for s in admitted_a if s < b) == LORA_WAIT_STEPS
    assert all(step in admitted_at.values() for step in range(b))  # base ones all along
    assert any(step > b for step in admitted_a)  # A comes back once B is done


def test_no_preemption_for_requests_the_drain_keeps_out(monkeypatch):
    """Under priority, once the places are drained for a waiting adapter, requests of
    the other adapters make no room: nothing is preempted for them (before, base requests
    were preempted and re-admitted every step). Admission resets a request's wait."""
    import pagedserve.engine.core.lora_slots as slots

    monkeypatch.setattr(slots, "LORA_WAIT_STEPS", 5)
    s, runner = make_scheduler(max_num_seqs=4, budget=256, max_loras=1,
                               scheduling_policy="priority"), FakeRunner()  # fmt: skip
    s.add_request(_req("x0", "A", priority=0, max_tokens=30))  # holds A's place
    for i in range(3):
        s.add_request(_req(f"base{i}", None, priority=2, max_tokens=200))
    run_step(s, runner)
    s.add_request(_req("y", "B", priority=1, max_tokens=4))
    admitted_y = False
    for step in range(60):
        s.add_request(_req(f"a{step}", "A", priority=1, max_tokens=2))
        out = run_step(s, runner)
        assert len(_adapters_of(s, out)) <= 1
        new = {n.req_id for n in out.new_requests}
        assert not new & set(out.preempted_req_ids), step  # no room made for nothing
        if "y" in new:
            admitted_y = True
            assert s.requests["y"].lora_waited_steps == 0
    assert admitted_y and "y" not in s.requests  # admitted once x0 was done, and finished


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(40))
def test_random_traces_hold_the_limit_and_finish(policy, seed):
    rng = random.Random(seed)
    max_loras = rng.choice([1, 2])
    s = make_scheduler(num_blocks=rng.choice([12, 24, 48]), max_num_seqs=rng.choice([2, 4, 8]),
                       budget=rng.choice([8, 16, 64]), max_loras=max_loras,
                       scheduling_policy=policy)  # fmt: skip
    runner = FakeRunner()
    pending = [_req(f"r{i}", rng.choice([None, "A", "B", "C", "D"]),
                    priority=rng.randint(-2, 2) if policy == "priority" else 0,
                    prompt_len=rng.randint(1, 12), max_tokens=rng.randint(1, 8))
               for i in range(rng.randint(4, 16))]  # fmt: skip
    for step in range(1000):
        while pending and rng.random() < 0.4:
            s.add_request(pending.pop(0))
        if not pending and not s.has_unfinished():
            break
        out = run_step(s, runner)
        assert len(_adapters_of(s, out)) <= max_loras, step
    else:
        raise AssertionError("the trace did not finish")
    assert s.kv.num_free_blocks == s.kv.num_blocks
