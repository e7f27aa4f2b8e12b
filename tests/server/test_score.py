"""``/v1/score`` and ``/v1/rerank``: the cosine similarity of the texts' embeddings (those
of ``/v1/embeddings``), one against many or pairwise; rerank orders documents by it and
keeps ``top_n``; bad requests are 400s naming the field."""

from __future__ import annotations

import math

import pytest
import requests

from tests.helpers.server import ServerProcess

ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25", "--max-model-len",
        "512", "--dtype", "float32", "--log-level", "warning"]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.",
        "France's capital city is Paris, on the Seine.", "The stock market fell today."]


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(ARGS) as srv:
        yield srv


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=60)


@pytest.fixture(scope="module")
def vectors(server):
    r = post(server, "/v1/embeddings", {"input": [QUERY, *DOCS], "encoding_format": "float"})
    return [d["embedding"] for d in r.json()["data"]]


def cos(a, b) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def test_score_is_the_cosine_of_the_embeddings(server, vectors):
    q, docs = vectors[0], vectors[1:]
    r = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in r["data"]] == [0, 1, 2, 3]
    for d, v in zip(r["data"], docs, strict=True):
        assert d["object"] == "score" and math.isclose(d["score"], cos(q, v), abs_tol=1e-5)
    pairs = post(server, "/score", {"text_1": [QUERY, DOCS[1]], "text_2": [DOCS[0], DOCS[1]]})
    s = [d["score"] for d in pairs.json()["data"]]
    assert math.isclose(s[0], cos(q, docs[0]), abs_tol=1e-5) and math.isclose(s[1], 1.0,
                                                                              abs_tol=1e-5)
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_relevance(server, vectors, path):
    q, docs = vectors[0], vectors[1:]
    want = sorted(range(len(DOCS)), key=lambda i: -cos(q, docs[i]))
    r = post(server, path, {"query": QUERY, "documents": DOCS}).json()
    assert [x["index"] for x in r["results"]] == want
    assert [x["document"]["text"] for x in r["results"]] == [DOCS[i] for i in want]
    scores = [x["relevance_score"] for x in r["results"]]
    assert scores == sorted(scores, reverse=True)
    top = post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 2,
                              "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == want[:2]
    assert all("document" not in x for x in top["results"])
    every = post(server, path, {"query": QUERY, "top_n": -1,
                                "documents": [{"text": d} for d in DOCS]}).json()  # fmt: skip
    assert [x["index"] for x in every["results"]] == want


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1"),
    ("/v1/score", {"text_1": 5, "text_2": "b"}, "text_1"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [{"title": "a"}]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["word " * 600]}, "documents"),
])
def test_bad_requests_name_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
