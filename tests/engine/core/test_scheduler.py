"""The scheduler on a fake model side: budgets, chunking, preemption order, prefix hits,
and the step contract (plain-data diffs that rebuild the runner's view exactly)."""

from __future__ import annotations

import pytest

from pagedserve.engine.core.request import RequestStatus
from pagedserve.engine.speculative import SpeculativeConfig
from tests.helpers.scheduler import (
    EOS,
    FakeRunner,
    make_request,
    make_scheduler,
    run_step,
)


def test_budget_chunks_prompts_and_decodes_go_first() -> None:
    s, runner = make_scheduler(budget=10), FakeRunner()
    a, b = make_request("a", list(range(10, 22))), make_request("b", list(range(30, 36)))
    s.add_request(a)
    s.add_request(b)
    out = run_step(s, runner)
    assert out.num_scheduled_tokens == {"a": 10}  # a's first chunk takes the whole budget
    assert [n.req_id for n in out.new_requests] == ["a"]
    out = run_step(s, runner)
    assert out.num_scheduled_tokens == {"a": 2, "b": 6}
    assert out.total_num_scheduled_tokens == 8
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    out = run_step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # decodes, oldest first
    assert [c.new_token_ids for c in out.cached_requests] == [[7], [7]]


def test_chunked_prefill_off_waits_for_room() -> None:
    s, runner = make_scheduler(budget=8, enable_chunked_prefill=False), FakeRunner()
    s.add_request(make_request("a", list(range(6))))
    s.add_request(make_request("b", list(range(20, 26))))
    assert run_step(s, runner).num_scheduled_tokens == {"a": 6}  # b's 6 do not fit the 2 left
    assert run_step(s, runner).num_scheduled_tokens == {"a": 1, "b": 6}


def test_max_num_seqs_caps_running() -> None:
    s, runner = make_scheduler(max_num_seqs=2, budget=64), FakeRunner()
    for i in range(3):
        s.add_request(make_request(f"r{i}", [1, 3, 4]))
    out = run_step(s, runner)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"] and s.num_waiting == 1


def test_preempts_newest_first_and_never_the_oldest() -> None:
    # 8 blocks of 4: three requests of 8 prompt tokens take 6; growth runs out.
    s, runner = make_scheduler(num_blocks=8, budget=64, watermark=0.0), FakeRunner()
    reqs = [make_request(f"r{i}", list(range(i * 10, i * 10 + 8)), max_tokens=12)
            for i in range(3)]  # fmt: skip
    for r in reqs:
        s.add_request(r)
    order = []
    for _ in range(60):
        if not s.has_unfinished():
            break
        out = run_step(s, runner)
        order += out.preempted_req_ids
        # The oldest running request is never the victim.
        if out.preempted_req_ids:
            assert s.running[0].request_id not in out.preempted_req_ids
    assert order and order[0] == "r2"
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert sum(r.metrics.num_preemptions for r in reqs) == s.num_preemptions == len(order)
    assert s.kv.stats().num_used_blocks == 0


def test_prefix_hit_is_sent_as_computed_tokens() -> None:
    s, runner = make_scheduler(budget=64), FakeRunner()
    first = make_request("a", list(range(100, 113)))  # 3 full blocks + 1 token
    s.add_request(first)
    run_step(s, runner)
    s.add_request(make_request("b", list(range(100, 113))))
    out = run_step(s, runner)
    (new,) = out.new_requests
    assert new.num_computed_tokens == 12  # three cached blocks
    assert new.block_ids[:3] == s.kv.get_block_table("a")[:3]
    assert out.num_scheduled_tokens["b"] == 1


def test_stops_and_finished_ids_reach_the_runner_once() -> None:
    s = make_scheduler(budget=64)
    runner = FakeRunner(next_token={"eos": EOS, "min": EOS, "ign": EOS, "stop": 9})
    s.add_request(make_request("eos", [1, 3, 4]))
    s.add_request(make_request("min", [1, 3, 4], min_tokens=2))
    s.add_request(make_request("ign", [1, 3, 4], max_tokens=3, ignore_eos=True))
    s.add_request(make_request("stop", [1, 3, 4], stop_token_ids=[9]))
    run_step(s, runner)
    assert s.requests.keys() == {"min", "ign"}  # eos and stop finished on their first token
    out = run_step(s, runner)
    assert sorted(out.finished_req_ids) == ["eos", "stop"]
    assert "min" not in s.requests  # EOS counts once min_tokens are out
    assert run_step(s, runner).finished_req_ids == ["min"]
    assert not s.has_unfinished()  # ign ignored three EOS and reached max_tokens=3
    assert s.schedule().finished_req_ids == []  # an empty step keeps them for the next
    s.add_request(make_request("next", [5]))
    assert run_step(s, runner).finished_req_ids == ["ign"]
    assert sorted(runner.seen_finished) == ["eos", "ign", "min", "stop"]


def test_aborted_waiting_request_frees_nothing_and_is_not_sent() -> None:
    s = make_scheduler()
    req = make_request("a", [1, 3])
    s.add_request(req)
    s.finish_request(req, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and s.schedule().finished_req_ids == []


def test_failed_step_errors_its_requests_and_frees_blocks() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", list(range(9))))
    out = s.schedule()
    s.fail_requests(out.num_scheduled_tokens)
    assert s.kv.stats().num_used_blocks == 0 and s.kv.stats().num_cached_blocks == 0
    assert not s.has_unfinished()


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_tokens_match_whatever_the_budget(budget) -> None:
    """The tokens a request ends with do not depend on how its prompt was chunked."""
    s, runner = make_scheduler(budget=budget), FakeRunner()
    reqs = [make_request(f"r{i}", list(range(i, i + 7 + i)), max_tokens=3) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    while s.has_unfinished():
        run_step(s, runner)
    assert [r.output_token_ids for r in reqs] == [[7, 7, 7]] * 3


def test_speculative_drafts_are_scheduled_verified_and_uncounted_when_rejected() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    s = make_scheduler(num_blocks=16, budget=16, speculative_config=spec)
    runner = FakeRunner(propose={"a": [40, 41, 42]}, accept={"a": 1})
    a = make_request("a", [1, 3, 4, 5, 6], max_tokens=10)
    s.add_request(a)
    run_step(s, runner)  # prefill; samples 7 and proposes three drafts
    assert a.spec_token_ids == [40, 41, 42]
    out = run_step(s, runner)
    assert out.scheduled_spec_decode_tokens == {"a": [40, 41, 42]}
    assert out.num_scheduled_tokens == {"a": 4}
    # One draft kept, then the verified token: two tokens, and only they are computed.
    assert a.output_token_ids == [7, 40, 7]
    assert a.num_computed_tokens == 5 + 1 + 1
    st = s.spec_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 3, 1)
    # The runner's view after the rejected drafts still equals the scheduler's.
    out = run_step(s, runner)
    assert out.cached_requests[0].new_token_ids == [40, 7]
    assert out.cached_requests[0].num_computed_tokens == 7


def test_drafts_respect_max_tokens_budget_and_batch_size() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=1)
    s = make_scheduler(num_blocks=32, budget=16, speculative_config=spec)
    runner = FakeRunner(propose={"a": [40, 41, 42, 43], "b": [50, 51, 52, 53]})
    a = make_request("a", [1, 3, 4], max_tokens=3)
    s.add_request(a)
    run_step(s, runner)
    out = run_step(s, runner)
    # 1 output so far, max_tokens 3: at most 1 draft, so that draft + 1 stays within 3.
    assert out.scheduled_spec_decode_tokens == {"a": [40]}
    assert a.is_finished and a.output_token_ids == [7, 40, 7]
    # Two running requests > disable_by_batch_size=1: nobody speculates.
    b, c = make_request("b", [1, 3, 4], max_tokens=8), make_request("c", [5, 6], max_tokens=8)
    s.add_request(b)
    s.add_request(c)
    run_step(s, runner)
    out = run_step(s, runner)
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {"b": 1, "c": 1}


def test_drafts_never_cause_a_preemption() -> None:
    # 4 blocks of 4 tokens; the prompts fill 3. a's drafts take the last block; b's would
    # need one more, so b decodes without them instead of preempting anyone.
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=4)
    s = make_scheduler(num_blocks=4, budget=32, speculative_config=spec, watermark=0.0)
    runner = FakeRunner(propose={"a": [40, 41, 42, 43], "b": [50, 51, 52, 53]})
    a, b = make_request("a", [1, 3, 4, 5, 6, 8, 9], max_tokens=8), make_request("b", [5, 6, 9])
    s.add_request(a)
    s.add_request(b)
    run_step(s, runner)
    out = run_step(s, runner)
    assert out.scheduled_spec_decode_tokens == {"a": [40, 41, 42, 43]}
    assert out.num_scheduled_tokens == {"a": 5, "b": 1}
    assert out.preempted_req_ids == [] and s.num_preemptions == 0


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3)
    s = make_scheduler(speculative_config=spec)
    runner = FakeRunner(propose={"a": [40, EOS, 42]})
    a = make_request("a", [1, 3, 4], max_tokens=10)
    s.add_request(a)
    run_step(s, runner)
    run_step(s, runner)
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [7, 40, EOS]
    assert s.kv.num_free_blocks == s.kv.num_blocks
