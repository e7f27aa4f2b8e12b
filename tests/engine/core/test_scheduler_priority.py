"""``scheduling_policy="priority"``: admission, step order and preemption by
(priority, arrival); a waiting request that outranks running ones takes their seat or
blocks; fcfs refuses priorities; the offline API and the server pass them through."""

from __future__ import annotations

import pytest

from pagedserve import LLM, EngineInputError, SamplingParams
from pagedserve.engine.core.request import RequestStatus
from pagedserve.engine.core.sampling_params import SamplingParamError
from pagedserve.engine.core.waiting_queue import WaitingQueue
from tests.helpers.scheduler import FakeRunner, make_request, make_scheduler, run_step


def _prio(rid, priority, prompt_len=4, max_tokens=4):
    """A request whose prompt shares no block with another's (distinct first token)."""
    first = 100 + sum(map(ord, rid)) * 7
    return make_request(rid, [first, *range(10, 9 + prompt_len)], max_tokens=max_tokens,
                        priority=priority)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s, runner = make_scheduler(max_num_seqs=1, budget=64, scheduling_policy="priority"), \
        FakeRunner()
    for rid, p in (("low", 5), ("first", 0), ("urgent", -3), ("second", 0)):
        s.add_request(_prio(rid, p))
    order = []
    while s.has_unfinished():
        out = run_step(s, runner)
        order += [n.req_id for n in out.new_requests]
    assert order == ["urgent", "first", "second", "low"]


def test_fcfs_keeps_arrival_order_and_a_preempted_request_goes_first():
    q = WaitingQueue("fcfs")
    a, b, c = _prio("a", 0), _prio("b", 0), _prio("c", 0)
    q.add(a)
    q.add(b)
    q.put_back(c)
    assert [r.request_id for r in q] == ["c", "a", "b"]
    q = WaitingQueue("priority")
    q.add(b)
    q.put_back(a)  # preempted: back before b, which arrived after it
    assert [r.request_id for r in q] == ["a", "b"]
    with pytest.raises(ValueError, match="scheduling_policy='lottery'"):
        WaitingQueue("lottery")


def test_an_urgent_request_takes_the_seat_of_the_least_urgent():
    s, runner = make_scheduler(max_num_seqs=2, budget=64, scheduling_policy="priority"), \
        FakeRunner()
    s.add_request(bg1 := _prio("bg1", 1, max_tokens=20))
    s.add_request(bg2 := _prio("bg2", 2, max_tokens=20))
    run_step(s, runner)
    run_step(s, runner)
    s.add_request(_prio("urgent", 0, max_tokens=2))
    out = run_step(s, runner)
    assert out.preempted_req_ids == ["bg2"]  # the least urgent of the two
    assert [n.req_id for n in out.new_requests] == ["urgent"]
    assert bg2.status is RequestStatus.PREEMPTED and bg1.status is RequestStatus.RUNNING
    assert list(out.num_scheduled_tokens) == ["bg1", "urgent"]
    while s.has_unfinished():
        run_step(s, runner)
    assert len(bg2.output_token_ids) == 20  # recomputed and finished
    assert s.kv.stats().num_used_blocks == 0


def test_an_equal_priority_waits_for_a_seat():
    s, runner = make_scheduler(max_num_seqs=1, budget=64, scheduling_policy="priority"), \
        FakeRunner()
    s.add_request(_prio("a", 0, max_tokens=6))
    run_step(s, runner)
    s.add_request(_prio("b", 0))
    out = run_step(s, runner)
    assert not out.preempted_req_ids and list(out.num_scheduled_tokens) == ["a"]


def test_an_urgent_request_takes_blocks_and_victims_are_least_urgent_first():
    # 16 blocks of 4 tokens: three 16-token prompts hold 12 of them (+ growth).
    s, runner = make_scheduler(num_blocks=16, budget=64, scheduling_policy="priority"), \
        FakeRunner()
    for rid, p in (("p1", 1), ("p3", 3), ("p2", 2)):
        s.add_request(_prio(rid, p, prompt_len=16, max_tokens=8))
    run_step(s, runner)
    assert s.kv.num_free_blocks == 4  # the urgent prompt needs 5
    s.add_request(_prio("urgent", 0, prompt_len=20, max_tokens=2))
    out = run_step(s, runner)
    assert out.preempted_req_ids[0] == "p3"
    assert "urgent" in [n.req_id for n in out.new_requests]
    assert "p1" in out.num_scheduled_tokens  # the most urgent running one is never a victim
    while s.has_unfinished():
        run_step(s, runner)
    assert s.kv.stats().num_used_blocks == 0


def test_when_blocks_run_out_mid_step_the_least_urgent_is_preempted():
    s, runner = make_scheduler(num_blocks=8, budget=64, scheduling_policy="priority",
                               watermark=0.0), FakeRunner()
    # x is admitted first, y (more urgent) after; then their growth needs more blocks.
    s.add_request(_prio("x", 3, prompt_len=12, max_tokens=12))
    run_step(s, runner)
    s.add_request(_prio("y", 1, prompt_len=12, max_tokens=12))
    out = run_step(s, runner)
    assert list(out.num_scheduled_tokens) == ["x", "y"]
    preempted = []
    while s.has_unfinished():
        out = run_step(s, runner)
        preempted += out.preempted_req_ids
        if preempted and "y" in out.num_scheduled_tokens:
            assert list(out.num_scheduled_tokens)[0] == "y"  # the most urgent goes first
    assert preempted == ["x"]


def test_priority_is_validated_and_refused_under_fcfs(tmp_path_factory, default_model_path,
                                                     make_tiny):
    with pytest.raises(SamplingParamError, match=r"priority=True is invalid"):
        SamplingParams(priority=True)
    with pytest.raises(SamplingParamError, match=r"priority=2147483648 is invalid"):
        SamplingParams(priority=2**31)
    path = make_tiny("llama", tmp_path_factory.mktemp("tiny-prio"), default_model_path)
    fcfs = LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.02)
    with pytest.raises(EngineInputError, match="scheduling_policy='fcfs'") as e:
        fcfs.generate(["a b"], SamplingParams(max_tokens=2), priority=[1], use_tqdm=False)
    assert e.value.param == "priority"
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in fcfs.generate(["a b", "c d e"], sp,
                                                           use_tqdm=False)]
    del fcfs
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.02,
              scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate(["a b", "c d e"], sp, priority=[5, -1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want  # outputs stay in input order
    # the urgent second prompt ran first
    assert outs[1].metrics.first_token_time < outs[0].metrics.first_token_time
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], sp, priority=[1], use_tqdm=False)


def test_the_server_passes_priority_and_names_it_in_a_400(tmp_path, default_model_path,
                                                          make_tiny):  # fmt: skip
    from pagedserve import EngineConfig
    from pagedserve.engine.loop.llm_engine import LLMEngine
    from pagedserve.server.options import ServeOptions
    from tests.helpers.server import run_in_process

    path = make_tiny("llama", tmp_path / "m", default_model_path)

    def answers(policy):
        engine = LLMEngine(EngineConfig.from_kwargs(
            model=str(path), dtype="float32", kv_cache_memory_gb=0.02,
            scheduling_policy=policy))

        async def script(client):
            out = []
            for body in ({"prompt": "a b", "max_tokens": 2, "priority": -4},
                         {"prompt": "a b", "max_tokens": 2, "priority": "high"}):
                r = await client.post("/v1/completions", json=body)
                out.append((r.status, await r.json()))
            return out

        return run_in_process(engine, ServeOptions(), script)

    (ok, body), (bad_type, err) = answers("priority")
    assert ok == 200 and body["usage"]["completion_tokens"] == 2
    assert bad_type == 400 and err["error"]["param"] == "priority"
    (status, err), _ = answers("fcfs")
    assert status == 400 and err["error"]["param"] == "priority"
    assert "scheduling_policy='fcfs'" in err["error"]["message"]


def test_several_urgent_requests_take_their_seats_in_one_step():
    s, runner = make_scheduler(max_num_seqs=3, budget=64, scheduling_policy="priority"), \
        FakeRunner()
    for rid, p in (("b1", 4), ("b2", 6), ("b3", 5)):
        s.add_request(_prio(rid, p, max_tokens=20))
    run_step(s, runner)
    for rid in ("u1", "u2", "late"):
        s.add_request(_prio(rid, {"u1": 0, "u2": 1, "late": 5}[rid]))
    out = run_step(s, runner)
    # u1 and u2 outrank b2 (6) and b3 (5); "late" (5) does not outrank b1 (4) or b3 (5)
    assert out.preempted_req_ids == ["b2", "b3"]
    assert [n.req_id for n in out.new_requests] == ["u1", "u2"]
    assert [r.request_id for r in s.waiting] == ["b3", "late", "b2"]
