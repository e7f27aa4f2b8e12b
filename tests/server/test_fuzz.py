"""Schema-driven fuzzing: requests generated from the server's own ``/openapi.json``
(valid ones and ones that break the schema), against a real server on a tiny random
model. No request may get a 5xx or hang (the client gives up before the server's
deadline would turn a hang into a 408, and a 408 fails too); a request that breaks the
schema must get a 4xx; every answer must match the document (status, content type, body
schema). The seed is fixed (``derandomize``) and the count bounded, so a run is
repeatable and takes a few minutes.

Generating the requests costs more than serving them (tens of ms each on two cores), and
it is single-threaded: the routes are fuzzed side by side, one worker process per core
(:mod:`tests.helpers.fuzz`), started with the server; each route's test waits for its
result. ``FUZZ_EXAMPLES=N`` sets another count of valid requests per route (half as
many break the schema)."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor

import pytest
import requests

from tests.helpers.fuzz import checked_call, fuzz_route
from tests.helpers.server import ServerProcess

SCHEDULE_FIRST = True
"""Among the longest modules of the suite: started first (``tests/conftest.py``)."""

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "600"))
"""Generated requests per route that follow the schema; half as many break it."""
NEGATIVE = EXAMPLES // 2
REQUEST_TIMEOUT = 20.0
"""The server's ``--request-timeout``: a generation request that runs this long is cut
off with a 408."""
CLIENT_TIMEOUT = 10.0
"""The fuzzer's wait for an answer, shorter than the server's deadline: a route that hangs
fails as a client timeout instead of passing as the server's 408."""
ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
          ("POST", "/v1/embeddings"), ("POST", "/v1/score"), ("POST", "/v1/rerank"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
          ("GET", "/v1/models/{model}"), ("GET", "/v1/responses/{response_id}"),
          ("DELETE", "/v1/responses/{response_id}"),
          ("GET", "/v1/responses/{response_id}/input_items"),
          ("GET", "/version"), ("GET", "/metrics"), ("GET", "/health"),
          ("GET", "/openapi.json")]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    # A small context and waiting limit keep every generated request cheap: prompts and
    # max_tokens past 96 tokens and more than 8 sequences are refused; 8 x 96 tokens on
    # a two-layer model is milliseconds.
    args = ["--model", str(tiny_model_factory("llama")), "--max-model-len", "96",
            "--kv-cache-memory-gb", "0.05", "--max-num-batched-tokens", "256",
            "--dtype", "float32", "--log-level", "error", "--api-key", KEY,
            "--request-timeout", str(REQUEST_TIMEOUT), "--max-waiting-requests", "8",
            "--served-model-name", "tiny"]
    with ServerProcess(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def fuzzed(server) -> dict[tuple[str, str], Future]:
    """Every route's fuzzing, submitted at once to a worker per core ("spawn": the workers
    import only what fuzzing needs)."""
    pool = ProcessPoolExecutor(max_workers=max(1, min(len(os.sched_getaffinity(0)), 4)),
                               mp_context=multiprocessing.get_context("spawn"))  # fmt: skip
    futures = {(m, p): pool.submit(fuzz_route, server.url, AUTH, m, p, EXAMPLES, NEGATIVE,
                                        CLIENT_TIMEOUT)
               for m, p in ROUTES}  # fmt: skip
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_openapi_document_describes_the_request_structs(server):
    doc = requests.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    assert doc["openapi"] == "3.1.0"
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "max_completion_tokens", "logit_bias"} <= set(chat["properties"])
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"] == (
        "#/components/schemas/CompletionRequest")
    assert {m for p in doc["paths"].values() for m in p} == {"get", "post", "delete"}
    assert requests.get(server.url + "/openapi.json", timeout=30).status_code == 401


MSG = [{"role": "user", "content": "Hi"}]
VALID = [
    ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 3}),
    ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 3, "stream": True,
                                      "stream_options": {"include_usage": True}}),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 2}),
    ("POST", "/v1/completions", {"prompt": ["Hi", "Yo"], "max_tokens": 3, "stream": True}),
    ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
    ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 3, "stream": True}),
    ("POST", "/v1/embeddings", {"input": ["Hi", "Yo"]}),
    ("POST", "/v1/score", {"text_1": "Hi", "text_2": ["Yo", "Hey"]}),
    ("POST", "/v1/rerank", {"query": "Hi", "documents": ["Yo", "Hey"]}),
    ("POST", "/tokenize", {"messages": MSG}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    ("GET", "/v1/models", None), ("GET", "/v1/models/{model}", None),
    ("GET", "/version", None), ("GET", "/metrics", None), ("GET", "/health", None),
    ("GET", "/openapi.json", None),
]


def test_valid_requests_get_2xx_bodies_that_match_the_document(server):
    """Generated requests seldom pass the server's range checks, so each route also gets
    requests known to succeed (streamed and not): each answers 2xx with a body the
    document describes, under the fuzzer's checks."""
    import schemathesis

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)
    for method, path, body in VALID:
        op = schema[path][method]
        case = op.Case(body=body) if body is not None else op.Case(
            path_parameters={"model": "tiny"} if "{model}" in path else None)
        response = checked_call(case, server.url, AUTH, CLIENT_TIMEOUT)
        assert 200 <= response.status_code < 300, (path, body, response.text[:300])


@pytest.mark.parametrize("method,path", ROUTES)
def test_no_server_error_from_generated_requests(server, fuzzed, method, path):
    result = fuzzed[(method, path)].result(timeout=1500)
    assert result.failure is None, result.failure
    # /health takes no input (not even the key): one request is all there is to send.
    expected = 1 if path == "/health" else (EXAMPLES + NEGATIVE) * 0.9
    assert sum(result.seen.values()) >= expected, result.seen
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def _fake_api() -> tuple[dict, dict]:
    """An OpenAPI document of one route per way to fail, and what each route answers:
    ``(status, content type, body, seconds to wait first)``."""
    body = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}

    def route(method: str, ok: dict | None = None, request: dict | None = None,
              kind: str = "application/json") -> dict:
        op = {"responses": {"200": {"description": "ok", "content": {
            kind: {"schema": ok or {"type": "object"}}}},
            "400": {"description": "bad"}}}
        if request:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": request}}}
        return {method: op}

    event = b'data: {"error": {"message": "x", "code": 500}}\n\ndata: [DONE]\n\n'
    doc = {"openapi": "3.1.0", "info": {"title": "t", "version": "1"}, "paths": {
        "/boom": route("get"), "/hang": route("get"), "/late": route("get"),
        "/stream": route("get", {"type": "string"}, kind="text/event-stream"), "/accepts": route("post", request=body),
        "/shape": route("get", ok={"type": "object", "required": ["id"]}),
        "/fine": route("post", ok={"type": "object", "required": ["id"]}, request=body)}}
    ok = (200, "application/json", b'{"id": "a"}', 0.0)
    answers = {"/boom": (500, "application/json", b"{}", 0.0), "/hang": (*ok[:3], 2.0),
               "/late": (408, "application/json", b"{}", 0.0),
               "/stream": (200, "text/event-stream", event, 0.0),
               "/accepts": ok, "/shape": (200, "application/json", b"{}", 0.0), "/fine": ok}
    return doc, answers


@pytest.mark.parametrize("method,path,expected", [
    ("GET", "/boom", "500"),
    ("GET", "/hang", "no answer within 0.5 s: the route hangs"),
    ("GET", "/late", "408: the request hung"),
    ("GET", "/stream", "a 500 error event"),
    ("POST", "/accepts", "Schema-violating request accepted"),
    ("GET", "/shape", "Response violates schema"),
    ("POST", "/fine", None),
])
def test_the_fuzzer_reports_each_failure(method, path, expected) -> None:
    """The harness itself, on a fake API: a 5xx, a hang past the client's timeout, a 408,
    a 5xx error event in a stream, a request that breaks the schema answered 200, and a
    200 body that does not match the document are each reported with the request; a route
    that answers as documented (refusing bodies that break the schema) passes."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    doc, answers = _fake_api()

    class Handler(BaseHTTPRequestHandler):
        def answer(self, status: int, kind: str, body: bytes, wait: float) -> None:
            time.sleep(wait)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/openapi.json":
                return self.answer(200, "application/json", json.dumps(doc).encode(), 0)
            return self.answer(*answers[self.path])

        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                n = json.loads(raw)["n"]
                valid = isinstance(n, int) and not isinstance(n, bool)
            except (ValueError, TypeError, KeyError):
                valid = False
            if self.path == "/fine" and not valid:
                return self.answer(400, "application/json", b"{}", 0)
            return self.answer(*answers[self.path])

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        result = fuzz_route(f"http://127.0.0.1:{httpd.server_port}", {}, method, path, 5, 5,
                            timeout=0.5)
    finally:
        httpd.shutdown()
    if expected is None:
        assert result.failure is None, result.failure
        assert sum(result.seen.values()) == 10 and result.seen.get(400, 0) > 0, result.seen
    else:
        assert result.failure is not None and expected in result.failure, result.failure
        assert "curl" in result.failure
