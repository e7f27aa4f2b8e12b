"""Hostile input through the real server: no 5xx from any body or header, timeouts on
slow clients, limits named in their errors, and the loop answering ``/health`` while
large requests are prepared."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest
import requests

from tests.helpers.server import ServerProcess

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
               "--max-model-len", "2048", "--dtype", "float32", "--log-level", "warning",
               "--api-key", KEY]
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
