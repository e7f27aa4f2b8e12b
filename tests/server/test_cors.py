"""Cross-origin requests: a browser's preflight is answered before the API-key check,
every response to an allowed origin (JSON, errors, streams) says so, and an origin not
in ``--allowed-origins`` gets nothing a browser would let its page read."""

from __future__ import annotations

import pytest

from pagedserve.server.cors import parse_origins
from pagedserve.server.state import ServeOptions
from tests.helpers.models import write_tiny_model
from tests.helpers.server import run_in_process, sse_events

APP = "https://chat.example.com"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from pagedserve import EngineConfig
    from pagedserve.engine.loop.llm_engine import LLMEngine

    path = write_tiny_model(tmp_path_factory.mktemp("tiny-cors"))
    return LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32",
                                              kv_cache_memory_gb=0.02, max_num_seqs=4))


def serve(engine, fn, **options):
    return run_in_process(engine, ServeOptions(**options), fn)


def test_any_origin_by_default_with_an_api_key(engine):
    async def run(client):
        r = await client.options("/v1/completions", headers=PREFLIGHT)
        assert r.status == 204  # no Authorization on a preflight, and none needed
        assert r.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert int(r.headers["Access-Control-Max-Age"]) > 0
        r = await client.post("/v1/completions", json=BODY, headers={"Origin": APP})
        assert r.status == 401  # the error is readable by the page
        assert r.headers["Access-Control-Allow-Origin"] == "*"
        r = await client.post("/v1/completions", json=BODY, headers={
            "Origin": APP, "Authorization": "Bearer k"})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["Access-Control-Allow-Origin"] == "*"
        assert r.headers["Access-Control-Expose-Headers"] == "Retry-After"
        assert sse_events(await r.read())[-1] == b"[DONE]"
        r = await client.get("/health")  # no Origin: no CORS headers
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers

    serve(engine, run, api_key="k")


def test_only_the_listed_origins(engine):
    async def run(client):
        r = await client.options("/v1/models", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
        assert (await r.json())["error"]["message"].startswith("origin 'https://evil.example'")
        r = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        r = await client.options("/v1/models", headers=PREFLIGHT)
        assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == APP
        assert r.headers["Vary"] == "Origin"
        r = await client.get("/v1/models", headers={"Origin": APP})
        assert r.headers["Access-Control-Allow-Origin"] == APP and r.headers["Vary"] == "Origin"

    serve(engine, run, allowed_origins=(APP, "http://localhost:3000"))


def test_none_no_cors_at_all(engine):
    async def run(client):
        r = await client.options("/v1/completions", headers=PREFLIGHT)
        assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers
        r = await client.get("/v1/models", headers={"Origin": APP})
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers

    serve(engine, run, allowed_origins=())


def test_allowed_origins_flag():
    assert parse_origins("*") == ("*",)
    assert parse_origins("") == ()
    assert parse_origins(" https://a.example/, http://localhost:3000 ") == (
        "https://a.example", "http://localhost:3000")
    with pytest.raises(ValueError, match="'a.example' is not an origin"):
        parse_origins("a.example")
