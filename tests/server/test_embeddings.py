"""``/v1/embeddings`` through the real ``openai`` SDK (which asks for base64 by default):
the vectors are the offline API's (``LLM.embed``, equal to HF transformers' as
tests/engine/loop/test_embed.py checks), in input order, as floats or base64, cut by
``dimensions``; bad requests are 400s naming the field."""

from __future__ import annotations

import math

import pytest
import requests

from pagedserve import LLM, PoolingParams
from tests.helpers.server import ServerProcess

ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25", "--max-model-len",
        "512", "--dtype", "float32", "--log-level", "warning"]
MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hello"]


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def offline(default_tokenizer):
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory_gb=0.25)
    full = [o.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    cut = [o.embedding for o in llm.embed(TEXTS, PoolingParams(dimensions=64), use_tqdm=False)]
    return full, cut


def close(a, b) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5)
                                    for x, y in zip(a, b, strict=True))  # fmt: skip


def test_vectors_equal_the_offline_api(client, offline, default_tokenizer):
    full, cut = offline
    r = client.embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    for d, want in zip(r.data, full, strict=True):
        assert len(d.embedding) == 576 and close(d.embedding, want)
        assert math.isclose(math.fsum(x * x for x in d.embedding), 1.0, rel_tol=1e-5)
    n = sum(len(default_tokenizer.encode(t)) for t in TEXTS)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (n, n)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in r.data]
    small = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=64)
    assert all(close(d.embedding, w) for d, w in zip(small.data, cut, strict=True))
    ids = [default_tokenizer.encode(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert all(close(d.embedding, w) for d, w in zip(by_ids.data, full[:2], strict=True))
    one = client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, full[2])


@pytest.mark.parametrize("extra, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": None}, 400, "input"),
    ({"input": [1.5]}, 400, "input"),
    ({"input": [[10, 99999999]]}, 400, "input"),
    ({"input": "word " * 600}, 400, "input"),
    ({"dimensions": 0}, 400, "dimensions"),
    ({"dimensions": 577}, 400, "dimensions"),
    ({"encoding_format": "hex"}, 400, "encoding_format"),
    ({"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"priority": -417050435359}, 400, "priority"),
    ({"priority": 3}, 400, "priority"),  # fcfs
    ({"model": "nope"}, 404, "model"),
])
def test_bad_requests_name_the_field(server, extra, status, param):
    body = {"model": MODEL, "input": "Hi", **extra}
    r = requests.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_long_input_cut_by_truncate_prompt_tokens(server, offline, default_tokenizer):
    ids = default_tokenizer.encode("word " * 600)
    r = requests.post(server.url + "/v1/embeddings", timeout=60, json={
        "model": MODEL, "input": "word " * 600, "truncate_prompt_tokens": 100,
        "encoding_format": "float"}).json()
    assert r["usage"]["prompt_tokens"] == 100 and len(ids) > 512
    r2 = requests.post(server.url + "/v1/embeddings", timeout=60, json={
        "model": MODEL, "input": [ids[-100:]], "encoding_format": "float"}).json()
    assert close(r["data"][0]["embedding"], r2["data"][0]["embedding"])  # r2 hits the cache
