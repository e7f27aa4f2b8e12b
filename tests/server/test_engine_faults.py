"""Faults inside the engine, through the app with a real engine on a tiny model: one bad
request fails alone, a failed forward is followed by a self-check, a stalled engine
refuses new work, and a dead engine makes ``serve`` exit non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagedserve.engine.loop.async_engine import AsyncEngine
from pagedserve.engine.output.processor import OutputProcessor
from pagedserve.server.app import build_app
from pagedserve.server.state import ServeOptions, ServerState
from tests.helpers.models import write_tiny_model
from tests.helpers.server import sse_events

POISON = 4242
"""A prompt token whose request the tests make fail."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-faults")))


@pytest.fixture(scope="module")
def engine(tiny_model):
    from pagedserve import EngineConfig
    from pagedserve.engine.loop.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(
        model=tiny_model, dtype="float32", kv_cache_memory_gb=0.02, max_num_seqs=4,
        max_num_batched_tokens=64, enable_prefix_caching=False))


def body(prompt, **kw):
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}


async def _serve(engine, fn, options=None):
    ae = AsyncEngine(engine)
    ae.start(asyncio.get_running_loop())
    state = ServerState(ae, options or ServeOptions())
    try:
        async with TestClient(TestServer(build_app(state))) as client:
            return await fn(client, ae)
    finally:
        ae.shutdown()
        state.close()


async def _completion(client, prompt, **kw):
    r = await client.post("/v1/completions", json=body(prompt, **kw))
    if kw.get("stream"):
        return r.status, sse_events(await r.read())
    return r.status, await r.json()


def test_failure_in_output_processing_fails_that_request_alone(engine, monkeypatch):
    original = OutputProcessor._process_token

    def flaky(self, s, now):
        if POISON in s.req.prompt_token_ids and s.num_output == 3:
            raise RuntimeError("detokenizer broke")
        return original(self, s, now)

    monkeypatch.setattr(OutputProcessor, "_process_token", flaky)

    async def run(client, ae):
        results = await asyncio.gather(
            _completion(client, [5, 6, 7]),
            _completion(client, [5, POISON, 7]),
            _completion(client, [5, POISON, 8], stream=True),
            _completion(client, [9, 10], n=2))
        after = await _completion(client, [5, 6, 7])
        return results, after, ae.is_alive

    (ok, bad, bad_stream, ok_n), after, alive = asyncio.run(_serve(engine, run))
    assert ok[0] == 200 and ok[1]["choices"][0]["finish_reason"] == "length"
    assert ok_n[0] == 200 and [c["finish_reason"] for c in ok_n[1]["choices"]] == [
        "length", "length"]
    assert bad[0] == 500 and bad[1]["error"]["code"] == 500
    status, events = bad_stream
    assert status == 200 and events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 500
    # The engine thread kept stepping, with the same greedy tokens.
    assert after[0] == 200 and after[1]["choices"] == ok[1]["choices"]
    assert alive
    assert engine.stats().kv_usage == 0.0 and not engine.has_unfinished_requests()


def test_failed_forward_fails_its_batch_then_the_engine_checks_itself(engine, monkeypatch):
    worker = engine.worker
    original = worker.execute
    calls = {"fail": 0, "self_check": 0}

    def execute(sched):
        reqs = engine.scheduler.requests
        if any(rid.startswith("self-check-") for rid in sched.num_scheduled_tokens):
            calls["self_check"] += 1
        if any(POISON in reqs[rid].prompt_token_ids for rid in sched.num_scheduled_tokens):
            calls["fail"] += 1
            raise RuntimeError("forward broke")
        return original(sched)

    monkeypatch.setattr(worker, "execute", execute)

    async def run(client, ae):
        bad = await _completion(client, [5, POISON, 7])
        after = await _completion(client, [5, 6, 7])
        return bad, after, ae.is_alive

    bad, after, alive = asyncio.run(_serve(engine, run))
    assert bad[0] == 500 and bad[1]["error"]["code"] == 500
    assert after[0] == 200 and after[1]["choices"][0]["finish_reason"] == "length"
    assert calls == {"fail": 1, "self_check": 1}
    assert alive and engine.stats().kv_usage == 0.0


def test_engine_that_fails_its_self_check_dies(engine, monkeypatch):
    worker = engine.worker
    original = worker.execute
    broken = {"on": False}

    def execute(sched):
        reqs = engine.scheduler.requests
        if any(POISON in reqs[rid].prompt_token_ids for rid in sched.num_scheduled_tokens):
            broken["on"] = True
        if broken["on"]:
            raise RuntimeError("device lost")
        return original(sched)

    monkeypatch.setattr(worker, "execute", execute)

    async def run(client, ae):
        bad = await _completion(client, [5, POISON, 7])
        for _ in range(100):
            if not ae.is_alive:
                break
            await asyncio.sleep(0.02)
        health = (await client.get("/health")).status
        late = await _completion(client, [5, 6, 7])
        return bad, health, late

    bad, health, late = asyncio.run(_serve(engine, run))
    assert bad[0] == 500
    assert health == 503
    assert late[0] == 503 and late[1]["error"]["code"] == 503
    engine.scheduler.fail_requests(list(engine.scheduler.requests))


def test_stalled_engine_refuses_new_requests(engine, monkeypatch):
    """A step that hangs turns /health to 503 and new requests get 503 at once (not a
    request that would wait behind the hung step)."""
    release = threading.Event()
    original = engine.step

    def hanging_step():
        if any(POISON in r.prompt_token_ids for r in engine.scheduler.requests.values()):
            release.wait(30)
        return original()

    monkeypatch.setattr(engine, "step", hanging_step)

    async def run(client, ae):
        ae.stall_timeout = 0.5
        first = asyncio.create_task(_completion(client, [5, POISON, 7]))
        await asyncio.sleep(1.0)
        health = (await client.get("/health")).status
        late = await asyncio.wait_for(_completion(client, [5, 6, 7]), 5)
        release.set()
        return health, late, await first

    health, late, first = asyncio.run(_serve(engine, run))
    assert health == 503
    assert late[0] == 503 and "progress" in late[1]["error"]["message"]
    assert first[0] == 200


def test_serve_exits_nonzero_when_the_engine_dies(engine, monkeypatch):
    from pagedserve.server import runner

    def dies():
        raise RuntimeError("engine thread bug")

    async def main(exit_on_death: bool):
        ae = AsyncEngine(engine)
        monkeypatch.setattr(engine, "step", dies)
        monkeypatch.setattr(AsyncEngine, "from_config", classmethod(lambda cls, cfg: ae))
        socks = []
        real_bind = runner.bind_socket
        monkeypatch.setattr(runner, "bind_socket",
                            lambda h, p: socks.append(real_bind(h, p)) or socks[-1])
        opts = ServeOptions(port=0, exit_on_engine_death=exit_on_death, shutdown_timeout=2)
        task = asyncio.create_task(runner.serve(None, opts))
        while not socks:
            await asyncio.sleep(0.01)
        url = runner.url_of(socks[0])

        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body([5, 6])) as r:
                status = r.status
        done, _ = await asyncio.wait({task}, timeout=10)
        if not done:
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/health") as r:
                    health = r.status
            os.kill(os.getpid(), signal.SIGTERM)
            return status, await asyncio.wait_for(task, 10), health
        return status, task.result(), None

    assert asyncio.run(main(True)) == (500, 1, None)
    engine.scheduler.fail_requests(list(engine.scheduler.requests))
    status, _, health = asyncio.run(main(False))
    assert (status, health) == (500, 503)
    engine.scheduler.fail_requests(list(engine.scheduler.requests))
