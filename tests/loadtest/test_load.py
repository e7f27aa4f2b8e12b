"""A bounded load test against a real server, and tests that its checks can fail.

The load test drives a fresh ``pagedserve serve`` (default model, float32, CPU) with 200
streaming requests at concurrency 32 through the ``bench serve`` client, then requires
zero failed requests, every stream well formed (one finish chunk per choice,
``[DONE]`` last, usage present) and the KV cache empty with nothing running or waiting.

The other tests run the same client and checks against an in-process fake server whose
streams lose ``[DONE]``, carry two finish chunks or answer HTTP 500, and against metrics
text with leaked blocks, and show each problem is reported.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from pagedserve.loadtest.datasets import SampleRequest, random_dataset, vocabulary_ids
from pagedserve.loadtest.serve_bench import (
    StreamChecker,
    run_benchmark,
    run_problems,
    server_idle_problems,
    wait_server_idle,
)

SCHEDULE_FIRST = True
"""Among the longest modules of the suite: started first (``tests/conftest.py``)."""

NUM_REQUESTS = 200
CONCURRENCY = 32


def load_test_problems(report: dict[str, Any], idle_problems: list[str]) -> list[str]:
    """Everything that makes a load test fail: the run's problems and the server's."""
    return run_problems(report) + idle_problems


# -- the load test -----------------------------------------------------------------------
@pytest.mark.slow
def test_load_200_streams_at_concurrency_32(default_tokenizer) -> None:
    from tests.helpers.server import ServerProcess

    samples = random_dataset(vocabulary_ids(default_tokenizer), NUM_REQUESTS,
                             input_len=24, output_len=12, range_ratio=0.3, seed=0)
    assert all(8 <= s.expected_output_len <= 16 for s in samples)
    with ServerProcess(["--dtype", "float32", "--device", "cpu",
                        "--log-level", "warning"]) as srv:
        report = asyncio.run(run_benchmark(srv.url, samples, endpoint="/v1/completions",
                                           max_concurrency=CONCURRENCY, seed=0,
                                           check_metrics=True))
        idle = asyncio.run(wait_server_idle(srv.url, timeout=15.0))
    assert load_test_problems(report, idle) == [], json.dumps(
        {k: v for k, v in report.items() if k != "requests"}, indent=1)
    assert report["successful_requests"] == NUM_REQUESTS
    # ignore_eos + max_tokens: every output has exactly the requested length.
    assert report["total_output_tokens"] == sum(s.expected_output_len for s in samples)
    assert report["usage_reported"]
    assert all(r["itl"] and len(r["itl"]) <= r["output_tokens"] - 1 for r in report["requests"])
    server = report["server_metrics"]
    assert server["ttft"]["server_count"] == NUM_REQUESTS
    assert server["e2e"]["server_count"] == NUM_REQUESTS
    # The server's mean latencies are inside the client's: its interval (arrival to first
    # or last token) is nested in the client's (send to first or last byte), so it is
    # never longer (5% and 5 ms for the two clocks). The client's own work on a busy host
    # makes its latencies longer by no fixed ratio, so the lower bound only catches a
    # wrong unit or interval (10x); the latencies themselves are `pagedserve bench serve`'s.
    for key in ("ttft", "e2e"):
        s, c = server[key]["server_mean_ms"], server[key]["client_mean_ms"]
        assert c * 0.1 <= s <= c * 1.05 + 5.0, (key, s, c)
    assert server["ttft"]["server_mean_ms"] <= server["e2e"]["server_mean_ms"]


# -- the checks themselves ---------------------------------------------------------------
def _chunk(text: str | None = None, finish: str | None = None, usage: dict | None = None,
           choices: bool = True) -> bytes:
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [choice] if choices else [], "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
GOOD = [_chunk("a"), _chunk("b", finish="length"), _chunk(usage=USAGE, choices=False),
        b"data: [DONE]\n\n"]
STREAMS: dict[str, list[bytes]] = {
    "good": GOOD,
    "no_done": GOOD[:-1],
    "two_finish": [_chunk("a", finish="stop"), _chunk("b", finish="length"), *GOOD[2:]],
    "no_finish": [_chunk("a"), _chunk("b"), *GOOD[2:]],
    "after_done": [*GOOD, _chunk("c")],
    "error_event": [_chunk("a"), b'data: {"error": {"message": "boom", "code": 500}}\n\n',
                    b"data: [DONE]\n\n"],
    "bad_framing": [_chunk("a"), b"data: {\"x\": 1}\ndata: 2\n\n", *GOOD[1:]],
}
MODES = ["good", "no_done", "two_finish", "no_finish", "after_done", "error_event",
         "bad_framing", "http500"]


def check(events: list[bytes], split: int = 7) -> StreamChecker:
    """A checker fed ``events`` in ``split``-byte pieces and closed."""
    c = StreamChecker()
    raw = b"".join(events)
    for i in range(0, len(raw), split):
        c.feed(raw[i:i + split], float(i))
    c.close()
    return c


def test_checker_accepts_a_well_formed_stream() -> None:
    c = check(GOOD)
    assert c.violations == [] and c.error is None
    assert c.text == "ab" and c.usage == USAGE and len(c.content_times) == 2


@pytest.mark.parametrize("mode,expected", [
    ("no_done", "without data: [DONE]"),
    ("two_finish", "2 finish chunks"),
    ("no_finish", "0 finish chunks"),
    ("after_done", "after [DONE]"),
    ("bad_framing", "malformed SSE event"),
])
def test_checker_flags_each_violation(mode: str, expected: str) -> None:
    c = check(STREAMS[mode])
    assert any(expected in v for v in c.violations), c.violations


def test_checker_counts_reasoning_as_generated_chunks() -> None:
    def think(text: str) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {
            "reasoning_content": text}, "finish_reason": None}]}).encode() + b"\n\n"

    c = check([think("hm"), think(" ok"), *GOOD])
    assert c.violations == [] and c.text == "ab" and c.reasoning == "hm ok"
    assert len(c.content_times) == 4  # the first token is the first thought


def test_checker_flags_truncation_and_missing_usage() -> None:
    c = check([_chunk("a"), _chunk("b", finish="length"), b"data: [DONE]\n\n"])
    assert any("no usage" in v for v in c.violations)
    c = check([*GOOD[:-1], b"data: [DO"])
    assert any("ends inside an event" in v for v in c.violations)


class FakeServer:
    """An in-process OpenAI-like server whose ``/v1/completions`` stream is chosen by the
    first prompt token (an index into :data:`MODES`) and whose ``/metrics`` is settable."""

    def __init__(self) -> None:
        self.metrics = ("pagedserve:kv_cache_usage_perc{model_name=\"m\"} 0.0\n"
                        "pagedserve:num_requests_running{model_name=\"m\"} 0.0\n"
                        "pagedserve:num_requests_waiting{model_name=\"m\"} 0.0\n")
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode = MODES[body["prompt"][0]]
        if mode == "http500":
            return web.json_response({"error": {"message": "internal", "type": "x",
                                                "param": None, "code": 500}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ev in STREAMS[mode]:
            await resp.write(ev)
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics)

    async def run(self, fn: Callable[[str], Any]) -> Any:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics_route)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock)
        await site.start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            return await fn(self.url)
        finally:
            await runner.cleanup()


def _run_modes(modes: list[str]) -> dict[str, Any]:
    samples = [SampleRequest(prompt=[MODES.index(m)], prompt_len=1, expected_output_len=2)
               for m in modes]
    srv = FakeServer()
    return asyncio.run(srv.run(lambda url: run_benchmark(url, samples, max_concurrency=4)))


def test_clean_run_passes_the_load_test_checks() -> None:
    report = _run_modes(["good"] * 6)
    assert load_test_problems(report, server_idle_problems(FakeServer().metrics)) == []
    assert report["successful_requests"] == 6 and report["total_output_tokens"] == 12


@pytest.mark.parametrize("mode", ["no_done", "two_finish", "http500", "error_event"])
def test_one_bad_request_fails_the_load_test(mode: str) -> None:
    report = _run_modes(["good"] * 5 + [mode])
    problems = load_test_problems(report, [])
    assert problems, report
    assert report["failed_requests"] == 1 and report["successful_requests"] == 5
    bad = [r for r in report["requests"] if not r["success"]]
    assert len(bad) == 1
    if mode == "http500":
        assert bad[0]["status"] == 500 and bad[0]["error"].startswith("HTTP 500")
    elif mode == "error_event":
        assert "boom" in bad[0]["error"]
    else:
        assert bad[0]["violations"]


def test_lenient_mode_counts_violations_without_failing() -> None:
    samples = [SampleRequest(prompt=[MODES.index("no_done")], prompt_len=1,
                             expected_output_len=2)]
    srv = FakeServer()
    report = asyncio.run(srv.run(lambda url: run_benchmark(url, samples, strict=False)))
    assert report["failed_requests"] == 0 and report["stream_violations"] == 1
    assert run_problems(report) == ["1 requests with stream violations"]


def test_leaked_blocks_fail_the_load_test() -> None:
    srv = FakeServer()
    srv.metrics = srv.metrics.replace("kv_cache_usage_perc{model_name=\"m\"} 0.0",
                                      "kv_cache_usage_perc{model_name=\"m\"} 0.0125")
    srv.metrics = srv.metrics.replace("num_requests_running{model_name=\"m\"} 0.0",
                                      "num_requests_running{model_name=\"m\"} 1.0")
    problems = asyncio.run(srv.run(lambda url: wait_server_idle(url, timeout=0.3)))
    assert any("kv_cache_usage_perc = 0.0125" in p for p in problems)
    assert any("num_requests_running = 1" in p for p in problems)
    report = _run_modes(["good"])
    assert load_test_problems(report, problems)
    assert server_idle_problems("") == [
        "pagedserve:kv_cache_usage_perc is missing", "pagedserve:num_requests_running is missing",
        "pagedserve:num_requests_waiting is missing"]


def test_bench_flags_take_the_serve_spellings_too() -> None:
    from pagedserve.server.cli import build_parser

    parse = build_parser().parse_args
    for bench in ("throughput", "prefix"):
        assert parse(["bench", bench]).enable_chunked_prefill is True
        for off in ("--no-chunked-prefill", "--no-enable-chunked-prefill"):
            assert parse(["bench", bench, off]).enable_chunked_prefill is False
        assert parse(["bench", bench, "--no-chunked-prefill", "--enable-chunked-prefill"]
                     ).enable_chunked_prefill is True
    assert parse(["bench", "prefix", "--repeat", "5"]).repeats == 5
