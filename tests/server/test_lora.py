"""LoRA adapters on the server: served under their own names (``--lora-modules``), listed
by ``/v1/models`` with the base model as parent, chosen by a request's ``model``, and
added or removed at run time (``--allow-runtime-lora-updating``), with vLLM's bodies."""

from __future__ import annotations

import argparse

import pytest

from pagedserve import LLM, EngineConfig, LoRARequest, SamplingParams
from pagedserve.engine.loop.llm_engine import LLMEngine
from pagedserve.server import serve_cli
from pagedserve.server.lora import LoRAModule, parse_lora_module
from pagedserve.server.options import ServeOptions
from tests.helpers.lora import make_adapter
from tests.helpers.server import ServerProcess, run_in_process

PROMPT = "The quick brown fox"
MAX = 10


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory, default_model_path):
    root = tmp_path_factory.mktemp("server-lora")
    return {"sql": make_adapter(tiny, root / "sql", rank=4, seed=5),
            "poet": make_adapter(tiny, root / "poet", rank=8, targets=("v_proj", "up_proj"),
                                 seed=6),
            # An adapter of another model: its config is fine, its weights do not fit.
            "misfit": make_adapter(default_model_path, root / "misfit", rank=2,
                                   targets=("q_proj",), seed=7),
            "cut": _cut(make_adapter(tiny, root / "cut", rank=2, seed=8))}


def _cut(path):
    """The adapter with its weights file cut short (its header intact)."""
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    return path


@pytest.fixture(scope="module")
def offline(tiny, adapters):
    """Greedy texts of the prompt through the offline API (equal to HF's, as
    tests/engine/lora/test_lora.py checks), per adapter (None: the base)."""
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8,
              kv_cache_memory_gb=0.02)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True)
    out = {None: llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(("sql", "poet"), start=1):
        req = LoRARequest(name, i, str(adapters[name]))
        out[name] = llm.generate([PROMPT], sp, use_tqdm=False,
                                 lora_request=req)[0].outputs[0].text  # fmt: skip
    assert len(set(out.values())) == 3  # each adapter changes the output
    return out


def _engine(tiny, **kw):
    return LLMEngine(EngineConfig.from_kwargs(model=str(tiny), dtype="float32",
                                              kv_cache_memory_gb=0.02, **kw))


def test_served_adapters(tiny, adapters, offline):
    engine = _engine(tiny, enable_lora=True, max_lora_rank=8, max_loras=2)
    options = ServeOptions(served_model_names=("base",), lora_modules=(
        LoRAModule("sql", str(adapters["sql"])),
        LoRAModule("poet", str(adapters["poet"]), base_model_name="my-base")))
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "ignore_eos": True}

    async def script(client):
        models = await (await client.get("/v1/models")).json()
        texts = {}
        for model in ("base", "sql", "poet"):
            r = await client.post("/v1/completions", json={**body, "model": model})
            got = await r.json()
            assert r.status == 200 and got["model"] == model, got
            texts[model] = got["choices"][0]["text"]
        # A streamed chat with an adapter: its chunks name the adapter.
        r = await client.post("/v1/chat/completions", json={
            "model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True})
        stream = (await r.read()).decode()
        one = await (await client.get("/v1/models/poet")).json()
        missing = await client.post("/v1/completions", json={**body, "model": "nope"})
        admin = await client.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                                 "lora_path": "/x"})
        return models, texts, stream, one, missing.status, await missing.json(), admin.status

    models, texts, stream, one, status, err, admin = run_in_process(engine, options, script)
    cards = {c["id"]: c for c in models["data"]}
    assert list(cards) == ["base", "sql", "poet"]
    assert cards["base"]["parent"] is None
    assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("base", str(adapters["sql"]))
    assert one["parent"] == "my-base" and one["id"] == "poet"
    assert texts == {"base": offline[None], "sql": offline["sql"], "poet": offline["poet"]}
    assert stream.count('"model":"sql"') >= 2 and stream.endswith("data: [DONE]\n\n")
    assert status == 404 and err["error"]["param"] == "model"
    assert admin == 404  # the run-time endpoints are off by default


def test_adapters_loaded_and_unloaded_at_run_time(tiny, adapters, offline):
    engine = _engine(tiny, enable_lora=True, max_lora_rank=8)
    options = ServeOptions(allow_runtime_lora_updating=True)
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "ignore_eos": True}

    async def script(client):
        out = []

        async def post(path, payload):
            r = await client.post(path, json=payload)
            out.append((path.rsplit("/", 1)[-1], payload.get("model", payload.get("lora_name")),
                        r.status, await r.text()))

        await post("/v1/completions", {**body, "model": "poet"})
        await post("/v1/load_lora_adapter", {"lora_name": "poet",
                                             "lora_path": str(adapters["poet"])})
        await post("/v1/completions", {**body, "model": "poet"})
        await post("/v1/load_lora_adapter", {"lora_name": "poet",
                                             "lora_path": str(adapters["sql"])})
        await post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/no/such"})
        await post("/v1/load_lora_adapter", {"lora_name": "misfit",
                                             "lora_path": str(adapters["misfit"])})
        await post("/v1/load_lora_adapter", {"lora_name": "cut",
                                             "lora_path": str(adapters["cut"])})
        await post("/v1/completions", {**body, "model": "cut"})
        await post("/v1/unload_lora_adapter", {"lora_name": "poet"})
        await post("/v1/completions", {**body, "model": "poet"})
        await post("/v1/unload_lora_adapter", {"lora_name": "poet"})
        await post("/v1/load_lora_adapter", {"lora_name": "poet"})
        await post("/v1/completions", {**body})
        return out

    import json

    out = run_in_process(engine, options, script)
    statuses = [s for _, _, s, _ in out]
    assert statuses == [404, 200, 200, 400, 400, 400, 200, 400, 200, 404, 404, 400, 200], out
    assert out[1][3] == "Success: LoRA adapter 'poet' added successfully."
    assert json.loads(out[2][3])["choices"][0]["text"] == offline["poet"]
    err = json.loads(out[3][3])["error"]
    assert err["param"] == "lora_name" and "already served" in err["message"]
    err = json.loads(out[4][3])["error"]
    assert err["param"] == "lora_path" and "has no adapter_config.json" in err["message"]
    err = json.loads(out[5][3])["error"]  # names and shapes are checked at once
    assert err["param"] == "lora_path" and "need (2, 64)" in err["message"], err
    err = json.loads(out[7][3])["error"]  # the data is read with the first request
    assert err["param"] == "model" and "not a readable safetensors file" in err["message"]
    assert out[8][3] == "Success: LoRA adapter 'poet' removed successfully."
    assert json.loads(out[11][3])["error"]["param"] == "lora_path"
    assert json.loads(out[12][3])["choices"][0]["text"] == offline[None]


def test_lora_module_flags(tiny, adapters):
    assert parse_lora_module("a=/p/q") == LoRAModule("a", "/p/q")
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "b"}') == \
        LoRAModule("a", "/p", "b")  # fmt: skip
    for bad, why in (("a", "name=path"), ("=x", "name=path"), ('{"name": 1}', "'name' and"),
                     ("{nope", "not valid JSON")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad)

    def check(modules, enable=True, rank=16, runtime=False):
        args = argparse.Namespace(lora_modules=modules, allow_runtime_lora_updating=runtime,
                                  served_model_name=None)
        return serve_cli._lora_modules(args, EngineConfig(enable_lora=enable, max_lora_rank=rank))

    assert check([f"sql={adapters['sql']}"]) == (LoRAModule("sql", str(adapters["sql"])),)
    cases = [(dict(modules=[f"sql={adapters['sql']}"], enable=False), "needs --enable-lora"),
             (dict(modules=None, enable=False, runtime=True),
              "--allow-runtime-lora-updating needs --enable-lora"),
             (dict(modules=[f"poet={adapters['poet']}"], rank=4), "larger than max_lora_rank=4"),
             (dict(modules=[f"a={adapters['sql']}", f"a={adapters['poet']}"]),
              "'a' is already served"),
             (dict(modules=["a=/no/such"]), "has no adapter_config.json")]  # fmt: skip
    for kw, why in cases:
        with pytest.raises(SystemExit, match=why):
            check(**kw)


def test_a_lora_module_that_does_not_fit_stops_the_server(tiny, adapters):
    srv = ServerProcess([str(tiny), "--dtype", "float32", "--kv-cache-memory-gb", "0.02",
                         "--enable-lora", "--lora-modules", f"m={adapters['misfit']}"])
    with pytest.raises(RuntimeError) as e:
        srv.start()
    assert "--lora-modules:" in str(e.value) and "need (2, 64)" in str(e.value)
    assert "Traceback" not in str(e.value)
    assert srv.proc.returncode == 2
