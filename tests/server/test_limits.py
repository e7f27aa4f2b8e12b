"""API key (401) and the bounded waiting queue (429 with Retry-After)."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from tests.helpers.server import ServerProcess, metric_value, sse_events

KEY = "test-key-123"
SERVER_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
               "--max-model-len", "2048", "--dtype", "float32", "--log-level", "warning",
               "--max-waiting-requests", "1", "--max-num-seqs", "1"]
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(SERVER_ARGS, env={"PAGEDSERVE_API_KEY": KEY}) as srv:
        yield srv


@pytest.mark.parametrize("method,route", [
    ("get", "/v1/models"), ("get", "/metrics"), ("get", "/version"),
    ("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("post", "/tokenize"),
])
def test_401_without_key(server, method, route):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = getattr(requests, method)(server.url + route, headers=headers, json={})
        assert r.status_code == 401, (route, headers)
        assert r.json()["error"]["code"] == 401


def test_key_accepted_and_health_open(server):
    assert requests.get(server.url + "/health").status_code == 200
    assert requests.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG,
                                         max_tokens=2, temperature=0)
    assert out.choices[0].message.content
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _waiting(url: str) -> float | None:
    text = requests.get(url + "/metrics", headers=AUTH).text
    return metric_value(text, "pagedserve:num_requests_waiting")


def test_429_when_waiting_queue_full(server):
    url = server.url + "/v1/chat/completions"
    long = {"messages": MSG, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    short = {"messages": MSG, "max_tokens": 3, "stream": True}
    with requests.post(url, json=long, headers=AUTH, stream=True) as a:
        lines = a.iter_lines()  # kept: closing the generator would close the connection
        for line in lines:
            if b'"content":"' in line and b'"content":""' not in line:
                break  # A is running (max_num_seqs=1)
        with requests.post(url, json=short, headers=AUTH, stream=True) as b:
            assert b.status_code == 200
            deadline = time.monotonic() + 5
            while _waiting(server.url) != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _waiting(server.url) == 1
            c = requests.post(url, json={**short, "stream": False}, headers=AUTH)
            assert c.status_code == 429, c.text
            assert c.headers["Retry-After"].isdigit()
            assert c.json()["error"]["code"] == 429
            a.close()  # A goes away: B runs and finishes normally
            events = sse_events(b"".join(b.iter_content(None)))
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks
            if ch["choices"][0]["finish_reason"]] == ["length"]
