"""Checks of a running server that more than one server configuration must pass (the
plain server and the tensor-parallel one): streaming equals the whole answer, a client
that disconnects frees its blocks, a full waiting queue answers 429."""

from __future__ import annotations

import json
import time

import requests

from tests.helpers.server import metric_value, sse_events

MODEL = "SmolLM2-135M-Instruct"
CHAT_PATH = "/v1/chat/completions"
# A chat and a prompt the API tests send the default model.
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPT = "The capital of France is"


def chat_prompt_len(tok, messages) -> int:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def chat_stream_equals_whole(client, tokenizer, messages) -> None:
    """The streamed deltas join to the whole answer, with the usage and framing the SDK
    reads."""
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           temperature=0)  # fmt: skip
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == chat_prompt_len(tokenizer, messages)
    assert whole.usage.completion_tokens == 16
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 16
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(messages=messages, model=MODEL, max_tokens=16,
                                            temperature=0, stream=True)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def kv_idle(url: str, deadline_s: float, headers: dict | None = None) -> tuple[bool, float]:
    """Whether the KV cache and the queues emptied within ``deadline_s``; how long it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        text = requests.get(url + "/metrics", headers=headers).text
        if (metric_value(text, "pagedserve:kv_cache_usage_perc") == 0.0
                and metric_value(text, "pagedserve:num_requests_running") == 0.0
                and metric_value(text, "pagedserve:num_requests_waiting") == 0.0):
            return True, time.monotonic() - t0
        time.sleep(0.02)
    return False, time.monotonic() - t0


def finished(url: str, reason: str, headers: dict | None = None) -> float:
    """How many requests finished for ``reason`` (``abort``, ``length``, ...)."""
    text = requests.get(url + "/metrics", headers=headers).text
    return metric_value(text, "pagedserve:request_success_total",
                        finished_reason=reason) or 0  # fmt: skip


def aborted(url: str, headers: dict | None = None) -> float:
    return finished(url, "abort", headers)


DISCONNECT_DEADLINE_S = 10.0
"""How long a disconnected request may take to be aborted and give its blocks back. The
check is that it was aborted (counted as ``abort``, not run to its ``length``) and that
nothing is left, which a busy host only delays; a request left running keeps its blocks
for the rest of its 1500 tokens and is never counted as aborted."""


def disconnected_request_freed(url: str, before: tuple[float, float],
                               headers: dict | None = None) -> None:
    """After a client went away mid-answer: its request was aborted rather than finished
    (``before``: the abort and length counts before it was sent) and the KV cache and the
    queues are empty, within :data:`DISCONNECT_DEADLINE_S`."""
    ok, took = kv_idle(url, DISCONNECT_DEADLINE_S, headers)
    counts = aborted(url, headers), finished(url, "length", headers)
    assert counts == (before[0] + 1, before[1]), (
        f"(aborted, finished by length) went from {before} to {counts}")
    assert ok, f"KV cache still in use {took:.2f}s after the disconnect"


def stream_disconnect_frees_blocks(url: str, messages, headers: dict | None = None) -> None:
    """A streaming client that goes away mid-answer: its request is aborted and its
    blocks are freed (:func:`disconnected_request_freed`)."""
    before = aborted(url, headers), finished(url, "length", headers)
    body = {"messages": messages, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with requests.post(url + CHAT_PATH, json=body, stream=True, headers=headers) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith(b"data: ") and b'"content":"' in line:
                seen += 1
                if seen >= 3:
                    break
        text = requests.get(url + "/metrics", headers=headers).text
        assert metric_value(text, "pagedserve:kv_cache_usage_perc") > 0
    # the connection is closed here
    disconnected_request_freed(url, before, headers)


def _waiting(url: str, headers: dict | None) -> float | None:
    text = requests.get(url + "/metrics", headers=headers).text
    return metric_value(text, "pagedserve:num_requests_waiting")


def queue_full_gives_429(url: str, messages, headers: dict | None = None) -> None:
    """On a server with ``--max-num-seqs 1 --max-waiting-requests 1``: one request runs,
    one waits, the next gets 429 with Retry-After; the waiting one then finishes."""
    path = url + CHAT_PATH
    long = {"messages": messages, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    short = {"messages": messages, "max_tokens": 3, "stream": True}
    with requests.post(path, json=long, headers=headers, stream=True) as a:
        lines = a.iter_lines()  # kept: closing the generator would close the connection
        for line in lines:
            if b'"content":"' in line and b'"content":""' not in line:
                break  # A is running (max_num_seqs=1)
        with requests.post(path, json=short, headers=headers, stream=True) as b:
            assert b.status_code == 200
            deadline = time.monotonic() + 5
            while _waiting(url, headers) != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _waiting(url, headers) == 1
            c = requests.post(path, json={**short, "stream": False}, headers=headers)
            assert c.status_code == 429, c.text
            assert c.headers["Retry-After"].isdigit()
            assert c.json()["error"]["code"] == 429
            a.close()  # A goes away: B runs and finishes normally
            events = sse_events(b"".join(b.iter_content(None)))
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks
            if ch["choices"][0]["finish_reason"]] == ["length"]
