"""Tests of ``pagedserve bench serve``: datasets, arrivals, statistics, server metrics,
the command line, and whole runs (single and sweep) against an in-process fake server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pagedserve.loadtest import serve_bench as sb
from pagedserve.loadtest import serve_bench_cli as sbc
from pagedserve.loadtest.datasets import (
    GROUNDED_TASKS,
    SampleRequest,
    conversation_dataset,
    grounded_dataset,
    length_range,
    load_conversations,
    random_dataset,
)


# -- datasets ----------------------------------------------------------------------------
def test_length_range() -> None:
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    assert length_range(1, 0.9) == (1, 1)
    with pytest.raises(ValueError):
        length_range(10, 1.0)
    with pytest.raises(ValueError):
        length_range(0, 0.0)


def test_random_dataset_lengths_prefix_and_seed() -> None:
    ids = list(range(100, 1100))
    a = random_dataset(ids, 50, input_len=40, output_len=10, range_ratio=0.25, prefix_len=16,
                       seed=3)
    assert len(a) == 50
    for s in a:
        assert isinstance(s.prompt, list) and s.prompt_len == len(s.prompt)
        assert 16 + 30 <= s.prompt_len <= 16 + 50 and 7 <= s.expected_output_len <= 12
        assert s.prompt[:16] == a[0].prompt[:16]
    assert a == random_dataset(ids, 50, 40, 10, 0.25, 16, seed=3)
    assert a != random_dataset(ids, 50, 40, 10, 0.25, 16, seed=4)


def test_random_dataset_text_form(default_tokenizer) -> None:
    from pagedserve.loadtest.datasets import vocabulary_ids

    ids = vocabulary_ids(default_tokenizer)
    assert not set(ids) & set(default_tokenizer.all_special_ids)
    (s,) = random_dataset(ids, 1, input_len=32, tokenizer=default_tokenizer, as_text=True)
    assert isinstance(s.prompt, str) and s.messages == [{"role": "user", "content": s.prompt}]


def test_conversation_dataset(default_tokenizer) -> None:
    convs = load_conversations()
    turns = sum(1 for c in convs for i, m in enumerate(c) if m["role"] == "assistant" and i)
    assert len(convs) >= 20 and turns > len(convs)  # some conversations are multi-turn
    samples = conversation_dataset(default_tokenizer, 2 * turns + 3, seed=1)
    assert len(samples) == 2 * turns + 3
    for s in samples:
        assert s.messages[-1]["role"] == "user" and s.messages[0]["role"] in ("system", "user")
        assert isinstance(s.prompt, str) and s.prompt.endswith("assistant\n")
        assert s.prompt_len > 0 and 1 <= s.expected_output_len <= 256
    fixed = conversation_dataset(default_tokenizer, 5, output_len=7)
    assert {s.expected_output_len for s in fixed} == {7}


def test_grounded_dataset_asks_for_the_replies_back(default_tokenizer) -> None:
    replies = [m["content"] for c in load_conversations() for m in c if m["role"] == "assistant"]
    samples = grounded_dataset(default_tokenizer, len(replies) + 2, seed=3)
    assert len(samples) == len(replies) + 2
    for s in samples:
        (msg,) = s.messages
        task, text = msg["content"].split("\n\n", 1)
        assert task in GROUNDED_TASKS and text in replies
        assert s.prompt_len > len(default_tokenizer.encode(text))
        assert s.expected_output_len == min(256, len(default_tokenizer(
            text, add_special_tokens=False)["input_ids"]))
    # Every reply appears once per pass.
    first = {s.messages[0]["content"].split("\n\n", 1)[1] for s in samples[: len(replies)]}
    assert first == set(replies)


def test_conversation_file_validation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_conversations(bad)


# -- load shape and statistics -----------------------------------------------------------
def test_arrival_gaps() -> None:
    assert sb.arrival_gaps(5, math.inf) == [0.0] * 5
    gaps = sb.arrival_gaps(4000, 10.0, 1.0, seed=0)
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01
    bursty = sb.arrival_gaps(4000, 10.0, 0.25, seed=0)
    assert abs(sum(bursty) / len(bursty) - 0.1) < 0.015
    var = sum((g - 0.1) ** 2 for g in gaps) / len(gaps)
    var_b = sum((g - 0.1) ** 2 for g in bursty) / len(bursty)
    assert var_b > 2 * var  # lower gamma shape = burstier
    with pytest.raises(ValueError):
        sb.arrival_gaps(3, 0.0)


def test_summarize_and_tpot() -> None:
    ok = sb.RequestResult(success=True, ttft=0.1, latency=1.0, itl=[0.3, 0.3, 0.3],
                          prompt_tokens=10, output_tokens=4, usage_reported=True)
    one = sb.RequestResult(success=True, ttft=0.2, latency=0.2, prompt_tokens=5,
                           output_tokens=1, usage_reported=True)
    bad = sb.RequestResult(error="HTTP 500: x", status=500)
    assert ok.tpot == pytest.approx(0.3) and one.tpot is None
    r = sb.summarize([ok, one, bad], duration=2.0)
    assert r["successful_requests"] == 2 and r["failed_requests"] == 1
    assert r["errors"] == {"HTTP 500": 1}
    assert r["total_output_tokens"] == 5 and r["total_input_tokens"] == 15
    assert r["output_throughput"] == 2.5 and r["total_token_throughput"] == 10.0
    assert r["request_throughput"] == 1.0
    assert r["tpot_ms"]["mean"] == pytest.approx(300.0)
    assert r["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert r["itl_ms"]["median"] == pytest.approx(300.0)
    assert r["e2el_ms"]["p99"] == pytest.approx(992.0)
    assert "Failed requests:" in sb.format_report(r | {"request_rate": "inf"})


METRICS_BEFORE = """# HELP x
pagedserve:time_to_first_token_seconds_sum{model_name="m"} 1.0
pagedserve:time_to_first_token_seconds_count{model_name="m"} 2.0
pagedserve:e2e_request_latency_seconds_sum{model_name="m"} 4.0
pagedserve:e2e_request_latency_seconds_count{model_name="m"} 2.0
"""
METRICS_AFTER = """pagedserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
pagedserve:time_to_first_token_seconds_sum{model_name="m"} 2.5
pagedserve:time_to_first_token_seconds_count{model_name="m"} 5.0
pagedserve:e2e_request_latency_seconds_sum{model_name="m"} 10.0
pagedserve:e2e_request_latency_seconds_count{model_name="m"} 5.0
"""


def test_server_histogram_means_cover_only_the_run() -> None:
    assert sb.histogram_mean(METRICS_BEFORE, METRICS_AFTER,
                             "pagedserve:time_to_first_token_seconds") == (0.5, 3)
    assert sb.histogram_mean("", METRICS_AFTER,
                             "pagedserve:e2e_request_latency_seconds") == (2.0, 5)
    assert sb.histogram_mean("", "", "pagedserve:e2e_request_latency_seconds") == (None, 0)
    report = {"ttft_ms": {"mean": 510.0}, "e2el_ms": {"mean": 2010.0}, "itl_ms": {"mean": 1.0}}
    cmp = sb.compare_server_metrics(METRICS_BEFORE, METRICS_AFTER, report)
    assert cmp["ttft"] == {"server_mean_ms": 500.0, "server_count": 3, "client_mean_ms": 510.0}
    assert cmp["e2e"]["server_mean_ms"] == 2000.0
    assert cmp["itl"]["server_mean_ms"] is None


def test_build_payload() -> None:
    s = SampleRequest(prompt=[1, 2, 3], prompt_len=3, expected_output_len=9,
                      messages=[{"role": "user", "content": "hi"}])
    body = sb.build_payload(s, "/v1/completions", "m")
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 9 and body["ignore_eos"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    chat = sb.build_payload(s, "/v1/chat/completions", "m", ignore_eos=False,
                            extra_body={"top_k": 5})
    assert chat["messages"] == s.messages and "prompt" not in chat
    assert "ignore_eos" not in chat and chat["top_k"] == 5
    with pytest.raises(ValueError):
        sb.build_payload(SampleRequest([1], 1, 1), "/v1/chat/completions", "m")


# -- whole runs against a fake server ----------------------------------------------------
def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    n = body["max_tokens"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if chat:
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                            "finish_reason": None}]}))
    for i in range(n):
        finish = "length" if i == n - 1 else None
        choice = ({"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": finish}
                  if chat else {"index": 0, "text": f" t{i}", "finish_reason": finish})
        await resp.write(_sse({"choices": [choice], "usage": None}))
        await asyncio.sleep(0.001)
    await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": 11,
                                                    "completion_tokens": n,
                                                    "total_tokens": 11 + n}}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "fake-model"}]})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=METRICS_AFTER)


@pytest.fixture(scope="module")
def fake_server() -> Any:
    """A fake OpenAI server in a background thread; yields its URL."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", _stream)
    app.router.add_post("/v1/chat/completions", _stream)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    runner = web.AppRunner(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_run_completions_with_poisson_rate(fake_server: str) -> None:
    samples = random_dataset(list(range(100, 200)), 12, input_len=8, output_len=5, seed=0)
    r = asyncio.run(sb.run_benchmark(fake_server, samples, request_rate=200.0,
                                     max_concurrency=3, check_metrics=True))
    assert sb.run_problems(r) == []
    assert r["model"] == "fake-model" and r["max_concurrency"] == 3
    assert r["total_output_tokens"] == 60 and r["total_input_tokens"] == 12 * 11
    assert all(len(q["itl"]) == 4 and q["ttft"] > 0 for q in r["requests"])
    assert r["tpot_ms"]["mean"] > 0 and r["server_metrics"]["ttft"]["server_count"] == 0


def test_run_chat_ttft_skips_the_empty_role_chunk(fake_server: str) -> None:
    s = SampleRequest(prompt="", prompt_len=3, expected_output_len=4,
                      messages=[{"role": "user", "content": "hi"}])
    r = asyncio.run(sb.run_benchmark(fake_server, [s], endpoint="/v1/chat/completions"))
    (q,) = r["requests"]
    assert q["success"] and q["text"] == " t0 t1 t2 t3" and len(q["itl"]) == 3


def _cli(argv: list[str]) -> argparse.Namespace:
    from pagedserve.server.cli import build_parser

    return build_parser().parse_args(argv)


def test_cli_registration_and_defaults() -> None:
    a = _cli(["bench", "serve"])
    assert a._bench_main is sbc.main
    assert a.endpoint == "/v1/completions" and math.isinf(a.request_rate)
    assert a.dataset == "random" and a.max_concurrency is None and a.strict_streams
    a = _cli(["bench", "serve", "--sweep", "1,8,32", "--request-rate", "4",
              "--no-ignore-eos", "--dataset", "conversation"])
    assert a.sweep == [1, 8, 32] and a.request_rate == 4.0 and not a.ignore_eos
    with pytest.raises(SystemExit):
        _cli(["bench", "serve", "--sweep", "0,2"])
    with pytest.raises(SystemExit):
        _cli(["bench", "serve", "--request-rate", "0"])


def test_main_sweep_saves_json_and_plot(fake_server: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sweep.json"
    args = _cli(["bench", "serve", "--base-url", fake_server, "--num-prompts", "6",
                 "--random-input-len", "8", "--random-output-len", "3", "--sweep", "1,2",
                 "--save-result", str(out), "--check-metrics", "--fail-on-error"])
    reports = sbc.main(args)
    assert [r["max_concurrency"] for r in reports] == [1, 2]
    saved = json.loads(out.read_text())
    assert [r["successful_requests"] for r in saved] == [6, 6]
    assert "requests" not in saved[0]
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Server /metrics vs client" in text


def test_main_conversation_chat(fake_server: str, tmp_path: Path) -> None:
    args = _cli(["bench", "serve", "--base-url", fake_server, "--dataset", "conversation",
                 "--endpoint", "/v1/chat/completions", "--num-prompts", "5",
                 "--conversation-output-len", "4", "--max-concurrency", "2",
                 "--save-result", str(tmp_path / "r.json"), "--save-detailed"])
    r = sbc.main(args)
    assert r["successful_requests"] == 5 and r["total_output_tokens"] == 20
    assert len(json.loads((tmp_path / "r.json").read_text())["requests"]) == 5


def test_main_names_bad_arguments_and_an_unreachable_server() -> None:
    """Ordinary mistakes end with one ``error:`` line, not a traceback."""
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        unused_tcp_port = sock.getsockname()[1]
    for argv, message in ((["--num-prompts", "0"], "--num-prompts=0 must be >= 1"),
                          (["--extra-body", "{bad"], "--extra-body is not valid JSON"),
                          (["--port", str(unused_tcp_port), "--num-prompts", "1"],
                           "could not read the model name")):
        with pytest.raises(SystemExit) as e:
            sbc.main(_cli(["bench", "serve", *argv]))
        assert str(e.value).startswith("error: ") and message in str(e.value)


def _dropping_server(drops: int) -> tuple[str, list[int], Any]:
    """A raw HTTP server that closes its first ``drops`` connections once it has read the
    request, without answering, then answers each request with one streamed chunk."""
    loop = asyncio.new_event_loop()
    seen = [0]
    answer = b"".join(_sse(x) for x in (
        {"choices": [{"index": 0, "text": " a", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                  "total_tokens": 3}})) + b"data: [DONE]\n\n"  # fmt: skip

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))  # fmt: skip
        await reader.readexactly(length)
        seen[0] += 1
        if seen[0] > drops:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(answer)
                         + answer)  # fmt: skip
            await writer.drain()
        writer.close()

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = server.sockets[0].getsockname()[1]

    def stop() -> None:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return f"http://127.0.0.1:{port}/v1/completions", seen, stop


async def _send_one(url: str) -> sb.RequestResult:
    import aiohttp

    payload = {"prompt": "x", "max_tokens": 1, "stream": True,
               "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session:
        return await sb.send_request(session, url, payload)


@pytest.mark.parametrize("drops,ok", [(1, True), (2, False)])
def test_a_request_the_server_dropped_unanswered_is_sent_once_more(drops: int, ok: bool) -> None:
    url, seen, stop = _dropping_server(drops)
    try:
        res = asyncio.run(_send_one(url))
    finally:
        stop()
    assert res.success is ok and res.reconnects == 1 and seen[0] == 2
    if ok:
        assert res.text == " a" and res.output_tokens == 1
        assert sb.summarize([res], 1.0)["reconnected_requests"] == 1
    else:
        assert res.error.startswith("ServerDisconnectedError")
