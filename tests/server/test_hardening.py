"""Hostile input through the real server: no 5xx from any body or header, timeouts on
slow clients, limits named in their errors, and the loop answering ``/health`` while
large requests are prepared."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest
import requests

from pagedserve.loadtest.health_bench import heavy_requests
from tests.helpers.server import ServerProcess, sse_events

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
               "--max-model-len", "2048", "--dtype", "float32", "--log-level", "warning",
               "--api-key", KEY, "--sse-write-timeout", "1"]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(SERVER_ARGS) as srv:
        yield srv


def post(server, route, body, **kw):
    if isinstance(body, bytes):
        return requests.post(server.url + route, data=body, timeout=60,
                             headers={"Content-Type": "application/json", **AUTH}, **kw)
    return requests.post(server.url + route, json=body, headers=AUTH, timeout=60, **kw)


def assert_error(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    return err


@pytest.mark.parametrize("route", [CHAT, COMP, "/tokenize", "/detokenize"])
def test_deeply_nested_json_is_400(server, route):
    body = b"[" * 5000 + b"]" * 5000
    err = assert_error(post(server, route, body), 400, None)
    assert "nested too deeply" in err["message"]
    inner = b'{"prompt": "x", "messages": [], "tool_choice": ' + body + b"}"
    assert_error(post(server, route, inner), 400, None)


@pytest.mark.parametrize("route", [CHAT, "/tokenize"])
def test_tool_call_arguments_nested_too_deeply_are_400(server, route):
    """Arguments sent as a JSON string are decoded by the server itself, bounded."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    messages = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    err = assert_error(post(server, route, {"messages": messages}), 400, "messages")
    assert err["message"] == ("messages[1].tool_calls[0].function.arguments is nested too "
                              "deeply: arrays and objects may be nested at most 128 levels")


@pytest.mark.parametrize("key", ["\u00b2", "--5", "5" * 5000, "\u0665", "1_0", " "])
def test_logit_bias_key_that_is_no_decimal_is_400(server, key):
    for route, body in ((CHAT, {"messages": MSG, "max_tokens": 2}),
                        (COMP, {"prompt": "Hi", "max_tokens": 2})):
        err = assert_error(post(server, route, {**body, "logit_bias": {key: 1}}), 400,
                           "logit_bias")
        assert "token ids" in err["message"]


def test_non_utf8_authorization_is_401(server):
    for value in (b"Bearer \xff\xfe\xfd", b"\xff\xfe " + KEY.encode(), b"Bearer " + b"\x80" * 64):
        r = requests.get(server.url + "/v1/models", headers={"Authorization": value},
                         timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == 401
    assert requests.get(server.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_405_keeps_allow(server):
    r = requests.get(server.url + CHAT, headers=AUTH, timeout=30)
    assert r.status_code == 405
    assert r.headers["Allow"] == "POST"
    assert r.json()["error"]["code"] == 405
    r = requests.delete(server.url + "/health", timeout=30)
    assert r.status_code == 405 and "GET" in r.headers["Allow"]


def _host_port(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname, u.port


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closes ``sock`` (None if still open after ``seconds``)."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0
    return None


def test_stop_length_and_logit_bias_entries_are_capped(server):
    body = {"messages": MSG, "max_tokens": 2}
    err = assert_error(post(server, CHAT, {**body, "stop": ["ok", "x" * 513]}), 400, "stop")
    assert "512" in err["message"] and "513" in err["message"]
    assert post(server, CHAT, {**body, "stop": ["x" * 512]}).status_code == 200
    bias = {str(t): 0.5 for t in range(301)}
    err = assert_error(post(server, COMP, {"prompt": "Hi", "max_tokens": 2,
                                           "logit_bias": bias}), 400, "logit_bias")
    assert "300" in err["message"] and "301" in err["message"]
    del bias["0"]
    assert post(server, COMP, {"prompt": "Hi", "max_tokens": 2,
                               "logit_bias": bias}).status_code == 200


def test_body_over_the_limit_is_413(server):
    body = b'{"prompt": "' + b"a" * (4 * 2**20) + b'"}'
    r = post(server, COMP, body)
    assert r.status_code == 413, r.text[:200]
    err = r.json()["error"]
    assert err["code"] == 413 and str(4 * 2**20) in err["message"]


def _metric(server, name, **labels):
    from tests.helpers.server import metric_value

    return metric_value(requests.get(server.url + "/metrics", headers=AUTH, timeout=30).text,
                        name, **labels) or 0.0


def _idle(server, within: float = 2.0) -> bool:
    """No request running or waiting and no KV block in use, within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(_metric(server, f"pagedserve:{m}") == 0 for m in (
                "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")):
            return True
        time.sleep(0.05)
    return False


def _request_bytes(host: str, path: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{headers}\r\n").encode() + body


def test_stream_whose_client_stops_reading_is_aborted(server):
    """The client keeps the connection open but takes no data: once the server's writes
    have waited --sse-write-timeout (1 s), the request is aborted and its blocks freed.
    Checked by the abort count (without the timeout nothing is aborted while the client
    stays), within a 30 s deadline that only a busy host comes near."""

    host, port = _host_port(server.url)
    before = _metric(server, "pagedserve:request_success_total", finished_reason="abort")
    # The echoed prompts (512 x 11 kB) are more than the socket buffers take.
    body = json.dumps({"prompt": ["hello " * 1800] * 4, "echo": True, "n": 128,
                       "max_tokens": 100, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    try:
        sock.sendall(_request_bytes(host, COMP, body, f"Authorization: Bearer {KEY}\r\n"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if _metric(server, "pagedserve:request_success_total",
                       finished_reason="abort") == before + 512:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the stream was not aborted")
        assert _idle(server)
    finally:
        sock.close()


T_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
          "--max-model-len", "2048", "--dtype", "float32", "--log-level", "warning",
          "--keep-alive-timeout", "2", "--body-timeout", "2", "--request-timeout", "4",
          "--max-waiting-requests", "4", "--max-num-seqs", "1"]


@pytest.fixture(scope="module")
def tserver(default_model_path):
    with ServerProcess(T_ARGS) as srv:
        yield srv


# The timeouts below are 2 s and 4 s; each test allows four times as long (a busy host
# delays a timer, it does not stop it), and without the timeout nothing would happen:
# aiohttp's own keep-alive is 75 s, and a body or a request has no deadline.
def test_idle_connection_is_closed(tserver):
    sock = socket.create_connection(_host_port(tserver.url))
    try:
        took = _closed_within(sock, 8)
        assert took is not None, "the idle connection was still open after 8 s"
    finally:
        sock.close()


def test_slow_headers_are_cut_off(tserver):
    """A client that trickles its headers (one byte every 0.3 s) is disconnected once the
    keep-alive timeout (2 s) has passed without a complete request (within 8 s)."""
    host, port = _host_port(tserver.url)
    sock = socket.create_connection((host, port))
    t0 = time.monotonic()
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        closed = False
        while time.monotonic() - t0 < 8:
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_within(sock, 0.3) is not None:
                closed = True
                break
        assert closed
    finally:
        sock.close()


def test_slow_body_is_408(tserver):
    host, port = _host_port(tserver.url)
    sock = socket.create_connection((host, port))
    try:
        head = _request_bytes(host, COMP, b"x" * 1000)[:-1000]
        sock.sendall(head + b'{"prompt": ')
        t0 = time.monotonic()
        sock.settimeout(8)
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert time.monotonic() - t0 > 1.5
        assert b'"code":408' in reply and b"--body-timeout" in reply
    finally:
        sock.close()


def test_request_deadline_is_408_and_frees_blocks(tserver):
    body = {"messages": MSG, "max_tokens": 1500, "ignore_eos": True}
    t0 = time.monotonic()
    r = requests.post(tserver.url + CHAT, json=body, timeout=16)
    assert time.monotonic() - t0 > 3.5
    err = assert_error(r, 408, None)
    assert "--request-timeout" in err["message"] and err["type"] == "RequestTimeoutError"
    assert _idle(tserver)
    with requests.post(tserver.url + CHAT, json={**body, "stream": True}, stream=True,
                       timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(b"".join(r.iter_content(None)))
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 408
    assert json.loads(events[-3])["choices"][0]["delta"]["content"]
    assert _idle(tserver)


def test_admission_counts_sequences(tserver):
    """--max-waiting-requests 4 counts prompts x n: one request of 6 sequences is refused
    outright, and one of 2 is refused while 3 wait."""
    err = assert_error(requests.post(tserver.url + COMP, json={
        "prompt": ["a", "b"], "n": 3, "max_tokens": 2}, timeout=30), 400, "n")
    assert "6 sequences" in err["message"] and "4" in err["message"]
    long = {"messages": MSG, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with requests.post(tserver.url + CHAT, json=long, stream=True, timeout=30) as a:
        lines = a.iter_lines()
        for line in lines:
            if b'"content":"' in line and b'"content":""' not in line:
                break  # A runs (max_num_seqs=1)
        with requests.post(tserver.url + COMP, json={"prompt": "b", "n": 3, "max_tokens": 2,
                                                      "stream": True},
                           stream=True, timeout=30) as b:
            assert b.status_code == 200
            deadline = time.monotonic() + 10
            while (_metric(tserver, "pagedserve:num_requests_waiting") != 3
                   and time.monotonic() < deadline):
                time.sleep(0.02)
            assert _metric(tserver, "pagedserve:num_requests_waiting") == 3
            c = requests.post(tserver.url + CHAT, json={"messages": MSG, "n": 2,
                                                        "max_tokens": 2}, timeout=30)
            assert c.status_code == 429, c.text
            assert c.headers["Retry-After"] == "1"
            assert "4 allowed" in c.json()["error"]["message"]
            a.close()
            b_events = sse_events(b"".join(b.iter_content(None)))
    assert b_events[-1] == b"[DONE]"


STATUS = {"tokenize": 200}
"""What each large request gets: the others are over a limit (400)."""
HEAVY = {kind: (route, body, STATUS.get(kind, 400))
         for kind, (route, body) in heavy_requests().items()}


def _thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of a process's main thread (the server's event loop) and of all its
    other threads together (``schedstat``'s nanoseconds where the kernel keeps them, else
    ``stat``'s clock ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    main = rest = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    seconds = int(f.read().split()[0]) / 1e9
            except OSError:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except (FileNotFoundError, ProcessLookupError):  # the thread ended
            continue
        if int(tid) == pid:
            main += seconds
        else:
            rest += seconds
    return main, rest


def _while_prepared(server, route, body, status) -> tuple[list[float], float, float, float]:
    """Send ``body`` to ``route`` and poll /health until it is answered: the /health
    latencies, the request's duration, and the CPU seconds the server's loop thread and
    its other threads spent meanwhile."""
    done = threading.Event()
    result = {}

    def send():
        try:
            t0 = time.monotonic()
            result["status"] = post(server, route, body).status_code
            result["took"] = time.monotonic() - t0
        finally:
            done.set()

    loop0, rest0 = _thread_cpu(server.pid)
    sender = threading.Thread(target=send)
    sender.start()
    latencies = []
    with requests.Session() as s:
        while not done.is_set():
            t0 = time.monotonic()
            assert s.get(server.url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)
    sender.join()
    loop1, rest1 = _thread_cpu(server.pid)
    assert result["status"] == status
    assert len(latencies) >= 2, latencies
    return latencies, result["took"], loop1 - loop0, rest1 - rest0


@pytest.mark.parametrize("case", list(HEAVY))
def test_health_answers_while_a_large_request_is_prepared(server, case):
    """Work that grows with the input runs off the event loop: while a request near the
    body limit is decoded, templated, tokenized or range-checked, the loop thread spends
    less than half the CPU time the other threads do (CPU time, which a busy host does not
    stretch; work on the loop puts nearly all of it there), and /health answers all the
    while, its slowest answer under a third of the request's own duration or 100 ms (a
    stall of the loop, or of the GIL, lasts about as long as the request; a busy host
    delays a poll now and then, so the best of three runs counts). ``pagedserve bench
    health`` measures the latencies themselves."""
    route, obj, status = HEAVY[case]
    body = json.dumps(obj).encode()
    assert len(body) < 4 * 2**20
    runs = []
    for _ in range(3):
        latencies, took, loop_cpu, other_cpu = _while_prepared(server, route, body, status)
        assert loop_cpu < other_cpu / 2, (
            f"the event loop's thread ran {loop_cpu:.3f} s of CPU, the others "
            f"{other_cpu:.3f} s: the request was prepared on the loop")
        if max(latencies) < max(0.1, took / 3):
            return
        runs.append((round(took, 2), [round(x, 2) for x in sorted(latencies)[-3:]]))
    pytest.fail("/health was slower than a third of the request's duration in every run; "
                f"(duration, slowest answers) per run: {runs}")


def test_bench_health_reports_the_latencies(server):
    import argparse

    from pagedserve.loadtest import health_bench

    parser = argparse.ArgumentParser()
    health_bench.add_arguments(parser)
    args = parser.parse_args(["--url", server.url, "--api-key", KEY, "--repeats", "1",
                              "--kinds", "detokenize,tokenize"])
    report = health_bench.main(args)
    rows = report["kinds"]
    assert [rows[k]["status"] for k in ("detokenize", "tokenize")] == [400, 200]
    for row in rows.values():
        assert row["health_polls"] >= 1 and 0 < row["health_p50_ms"] <= row["health_max_ms"]
        assert row["body_bytes"] > 2**20 and row["request_s"] > 0
