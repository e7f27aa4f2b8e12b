"""Schema-driven fuzzing: requests generated from the server's own ``/openapi.json``
(valid ones and ones that break the schema), against a real server on a tiny random
model. No request may get a 5xx or hang. The seed is fixed (``derandomize``) and the
count bounded, so a run is repeatable and takes a few minutes.

Generating the requests costs more than serving them (tens of ms each on two cores):
1,000 per route take about 3.5 minutes on a quiet 2-core machine. ``FUZZ_EXAMPLES=N``
sets another count."""

from __future__ import annotations

import os

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

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
def schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)


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
def test_no_server_error_from_generated_requests(server, schema, method, path):
    op = schema[path][method]
    strategy = (op.as_strategy(GenerationMode.POSITIVE)
                | op.as_strategy(GenerationMode.NEGATIVE))
    seen: dict[int, int] = {}
    session = requests.Session()

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(strategy)
    def run(case):
        response = case.call(base_url=server.url, session=session, headers=AUTH, timeout=30)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:300],
                                            case.as_curl_command())

    run()
    assert sum(seen.values()) >= EXAMPLES * 0.9, seen
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
