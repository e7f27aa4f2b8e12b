"""API key (401) and the bounded waiting queue (429 with Retry-After)."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.helpers.server import ServerProcess
from tests.helpers.server_checks import queue_full_gives_429

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
    client = server.openai_client(KEY)
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG,
                                         max_tokens=2, temperature=0)
    assert out.choices[0].message.content
    bad = server.openai_client("nope")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_429_when_waiting_queue_full(server):
    queue_full_gives_429(server.url, MSG, AUTH)
