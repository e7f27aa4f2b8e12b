"""SIGTERM during streams: short ones finish, long ones get an error event + [DONE], exit 0."""

from __future__ import annotations

import json
import signal
import time

import requests

from tests.helpers.server import ServerProcess, sse_events

SERVER_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
               "--max-model-len", "2048", "--dtype", "float32", "--log-level", "info",
               "--shutdown-timeout", "4"]
MSG = [{"role": "user", "content": "Tell me a story."}]


def _open(url: str, max_tokens: int):
    r = requests.post(url + "/v1/chat/completions", stream=True, json={
        "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "stream": True})
    assert r.status_code == 200
    return r


def _wait_for_content(pieces) -> bytes:
    """Read up to the first content event; return the raw bytes read so far."""
    raw = b""
    for piece in pieces:
        raw += piece
        if b'"content":"' in raw.replace(b'"content":""', b""):
            return raw
    return raw


def _refused(url: str) -> bool:
    try:
        r = requests.get(url + "/v1/models", timeout=2)
    except requests.ConnectionError:
        return True
    return r.status_code == 503


def test_sigterm_during_streams(default_model_path):
    srv = ServerProcess(SERVER_ARGS).start()
    try:
        # One iterator per stream, kept: closing it would close the connection.
        short = _open(srv.url, 6).iter_content(None)
        long = _open(srv.url, 1500).iter_content(None)
        got_short, got_long = _wait_for_content(short), _wait_for_content(long)
        srv.signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.3)
        refused = _refused(srv.url)
        got_short += b"".join(short)
        got_long += b"".join(long)
        code = srv.wait(30)
        took = time.monotonic() - t0
    finally:
        srv.kill()
    assert code == 0, srv.output
    assert refused, "a new connection was accepted during the shutdown"
    assert took < 4 + 10, took
    short_events = sse_events(got_short)
    assert short_events[-1] == b"[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in short_events[:-1]]
    assert finishes[-1] == "length", "the short stream should have finished normally"
    long_events = sse_events(got_long)
    assert long_events[-1] == b"[DONE]"
    err = json.loads(long_events[-2])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"]
    assert "shutdown complete" in srv.output

