"""The engine thread and the app against a scripted engine (no model): hand-back batching,
per-request errors, and what happens when the engine thread dies."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagedserve.engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.engine.errors import EngineDeadError, EngineInputError, InputField
from pagedserve.engine.loop.async_engine import AsyncEngine, StepItem
from pagedserve.engine.loop.engine_info import EngineInfo, InputLimits
from pagedserve.engine.loop.llm_engine import EngineStats
from pagedserve.server.app import build_app
from pagedserve.server.state import ServeOptions, ServerState
from tests.helpers.server import sse_events


class ScriptedEngine:
    """Emits one token "x" per request per step; ``fail_at_step`` kills the step loop."""

    def __init__(self, tokenizer, tokens_per_request: int = 3,
                 fail_at_step: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.info = EngineInfo(
            model_name="scripted", model_path="scripted", tokenizer=tokenizer,
            eos_token_ids=(), max_num_seqs=8,
            limits=InputLimits(vocab_size=49152, max_model_len=512, num_kv_blocks=64,
                               block_size=16, max_num_batched_tokens=512,
                               enable_chunked_prefill=True))
        self.tokens_per_request = tokens_per_request
        self.fail_at_step = fail_at_step
        self.live: dict[str, int] = {}
        self.steps = 0
        self.aborted: list[str] = []
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.finished_by_reason: dict[str, int] = {}

    def add_request(self, request_id, prompt_token_ids, params, **kw):
        if prompt_token_ids == [13]:
            raise EngineInputError("scripted rejection", InputField.PROMPT)
        self.live[request_id] = 0

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.live.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("scripted engine failure")
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] >= self.tokens_per_request
            if done:
                del self.live[rid]
            outs.append(RequestOutput(
                rid, None, [1], [CompletionOutput(0, "x", [87], None, None,
                                                  "length" if done else None)],
                done, RequestMetrics(arrival_time=0.0)))
        return outs


def _params():
    from pagedserve.engine.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=3)


async def _drain(q: asyncio.Queue) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), 5)
        items.append(item)
        if not isinstance(item, StepItem) or item.output.finished:
            return items


def test_one_handback_per_step_and_per_request_errors(default_tokenizer):
    async def main():
        eng = ScriptedEngine(default_tokenizer)
        ae = AsyncEngine(eng)
        calls = []
        original = ae._deliver
        ae._deliver = lambda items, t, snap: (calls.append(len(items)), original(items, t, snap))
        ae.start(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(3)]
        for i, q in enumerate(queues):
            ae.add_request(f"r{i}", [1, 2], _params(), q)
        bad = asyncio.Queue()
        ae.add_request("bad", [13], _params(), bad)
        results = await asyncio.gather(*(_drain(q) for q in queues))
        (err,) = await _drain(bad)
        ae.shutdown()
        return calls, results, err

    calls, results, err = asyncio.run(main())
    assert all(len(r) == 3 and r[-1].output.finished for r in results)
    assert max(calls) == 3  # all three requests' outputs of a step in one hand-back
    assert isinstance(err, ValueError)


def test_engine_death_fails_waiting_clients(default_tokenizer):
    async def main():
        eng = ScriptedEngine(default_tokenizer, tokens_per_request=100, fail_at_step=3)
        ae = AsyncEngine(eng)
        ae.start(asyncio.get_running_loop())
        q = asyncio.Queue()
        ae.add_request("r0", [1], _params(), q)
        items = await _drain(q)
        await asyncio.sleep(0.05)
        return ae, items

    ae, items = asyncio.run(main())
    assert isinstance(items[-1], EngineDeadError)
    assert not ae.is_alive
    with pytest.raises(EngineDeadError):
        ae.add_request("late", [1], _params(), asyncio.Queue())


def test_app_after_engine_death(default_tokenizer):
    async def main():
        eng = ScriptedEngine(default_tokenizer, tokens_per_request=100, fail_at_step=4)
        ae = AsyncEngine(eng)
        ae.start(asyncio.get_running_loop())
        state = ServerState(ae, ServeOptions())
        async with TestClient(TestServer(build_app(state))) as client:
            assert (await client.get("/health")).status == 200
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
                "stream": True})
            assert r.status == 200
            events = sse_events(await r.read())
            health = (await client.get("/health")).status
            late = await client.post("/v1/completions", json={"prompt": "hi"})
            return events, health, late.status, await late.json()

    events, health, late_status, late_body = asyncio.run(main())
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and "engine" in err["message"]
    assert health == 503
    assert late_status == 503 and late_body["error"]["code"] == 503
