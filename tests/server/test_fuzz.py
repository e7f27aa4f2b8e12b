"""Schema-driven fuzzing: requests generated from the server's own ``/openapi.json``
(valid ones and ones that break the schema), against a real server on a tiny random
model. No request may get a 5xx or hang. The seed is fixed (``derandomize``) and the
count bounded, so a run is repeatable and takes a few minutes.

Generating the requests costs more than serving them (tens of ms each on two cores), and
it is single-threaded: the routes are fuzzed side by side, one worker process per core
(:mod:`tests.helpers.fuzz`), started with the server; each route's test waits for its
result. ``FUZZ_EXAMPLES=N`` sets another count."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor

import pytest
import requests

from tests.helpers.fuzz import fuzz_route
from tests.helpers.server import ServerProcess

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
"""Generated requests per route (positive and negative together)."""
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
            "--request-timeout", "20", "--max-waiting-requests", "8"]
    with ServerProcess(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def fuzzed(server) -> dict[tuple[str, str], Future]:
    """Every route's fuzzing, submitted at once to a worker per core ("spawn": the workers
    import only what fuzzing needs)."""
    pool = ProcessPoolExecutor(max_workers=max(1, min(len(os.sched_getaffinity(0)), 4)),
                               mp_context=multiprocessing.get_context("spawn"))  # fmt: skip
    futures = {(m, p): pool.submit(fuzz_route, server.url, AUTH, m, p, EXAMPLES)
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


@pytest.mark.parametrize("method,path", ROUTES)
def test_no_server_error_from_generated_requests(server, fuzzed, method, path):
    result = fuzzed[(method, path)].result(timeout=1500)
    assert result.failure is None, result.failure
    assert sum(result.seen.values()) >= EXAMPLES * 0.9, result.seen
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_the_fuzzer_reports_a_server_error() -> None:
    """The harness itself: a route that answers 500 is reported with the request."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    doc = {"openapi": "3.1.0", "info": {"title": "t", "version": "1"},
           "paths": {"/boom": {"get": {"responses": {"200": {"description": "ok"}}}}}}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            ok = self.path == "/openapi.json"
            body = json.dumps(doc if ok else {"error": "boom"}).encode()
            self.send_response(200 if ok else 500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        result = fuzz_route(f"http://127.0.0.1:{httpd.server_port}", {}, "GET", "/boom", 5)
    finally:
        httpd.shutdown()
    assert result.failure is not None and "500" in result.failure and "curl" in result.failure
