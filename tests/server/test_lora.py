"""LoRA adapters on the server: served under their own names (``--lora-modules``), listed
by ``/v1/models`` with the base model as parent, chosen by a request's ``model``, and
added or removed at run time (``--allow-runtime-lora-updating``), with vLLM's bodies."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import struct
import time

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


def test_unloading_an_adapter_frees_its_weights(tiny, adapters, offline):
    """Adapters loaded, used and unloaded one after another under new names (what a
    deployment that rotates adapters does): none of the unloaded stays in memory."""
    engine = _engine(tiny, enable_lora=True, max_lora_rank=8)
    options = ServeOptions(allow_runtime_lora_updating=True)
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "ignore_eos": True}

    async def script(client):
        texts = []
        for i in range(4):
            name, path = f"turn{i}", adapters["sql" if i % 2 else "poet"]
            r = await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": name, "lora_path": str(path)})
            assert r.status == 200, await r.text()
            r = await client.post("/v1/completions", json={**body, "model": name})
            texts.append(json.loads(await r.text())["choices"][0]["text"])
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert r.status == 200, await r.text()
        await asyncio.sleep(0.2)  # the engine thread takes the last unload
        return texts

    texts = run_in_process(engine, options, script)
    assert texts == [offline["poet"], offline["sql"]] * 2
    assert engine.worker.loras.loaded_ids == []


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


def _copy(src, dst, config: str | None = None, header: bytes | None = None):
    """A copy of adapter ``src`` with its config's text or its weights' header replaced."""
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "adapter_config.json").write_text(config)
    if header is not None:
        (dst / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return str(dst)


DEEP = "[" * 5000 + "]" * 5000


def test_runtime_adapters_refuse_hostile_input(tiny, adapters, offline, tmp_path):
    """No body or adapter file makes a 5xx, nothing bad is registered, /v1/models keeps
    answering; an adapter whose weights file is overwritten once loaded serves on with
    the weights loaded, and one overwritten before its first use fails its requests
    alone with an error naming it."""
    engine = _engine(tiny, enable_lora=True, max_lora_rank=8)
    options = ServeOptions(allow_runtime_lora_updating=True)
    sql = str(adapters["sql"])
    cfg = json.loads((adapters["sql"] / "adapter_config.json").read_text())
    bad = {
        "deep_config": (_copy(adapters["sql"], tmp_path / "dc", json.dumps(
            {**cfg, "target_modules": "@"}).replace('"@"', DEEP)), "nested too deeply"),
        "alpha_inf": (_copy(adapters["sql"], tmp_path / "ai", json.dumps(
            {**cfg, "lora_alpha": "@"}).replace('"@"', "1e400")), "number out of range"),
        "alpha_huge": (_copy(adapters["sql"], tmp_path / "ah", json.dumps(
            {**cfg, "lora_alpha": "@"}).replace('"@"', "1" + "0" * 400)),
            "must be a finite number with |lora_alpha| <= 65536"),
        "deep_header": (_copy(adapters["sql"], tmp_path / "dh", header=DEEP.encode()),
                        "is nested too deeply"),
    }
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "ignore_eos": True}
    swap, late = _copy(adapters["sql"], tmp_path / "swap"), _copy(adapters["poet"],
                                                                   tmp_path / "late")

    async def script(client):
        async def post(path, payload):
            kw = {"data": payload, "headers": {"Content-Type": "application/json"}} \
                if isinstance(payload, bytes) else {"json": payload}  # fmt: skip
            r = await client.post(path, **kw)
            text = await r.text()
            return r.status, (json.loads(text).get("error") if r.status != 200 else text)

        load = "/v1/load_lora_adapter"
        out = {name: await post(load, {"lora_name": name, "lora_path": path})
               for name, (path, _) in bad.items()}  # fmt: skip
        out["surrogate"] = await post(load, {"lora_name": "\ud800", "lora_path": sql})
        out["control"] = await post(load, {"lora_name": "a\u0007", "lora_path": sql})
        out["long_name"] = await post(load, {"lora_name": "n" * 300, "lora_path": sql})
        out["long_path"] = await post(load, {"lora_name": "p", "lora_path": "/a" * 50000})
        out["nul_path"] = await post(load, {"lora_name": "p", "lora_path": sql + "\x00"})
        out["deep_body"] = await post(load, DEEP.encode())
        out["unload"] = await post("/v1/unload_lora_adapter", {"lora_name": "\x1b[2J"})
        models = await client.get("/v1/models")
        out["models"] = models.status, [m["id"] for m in (await models.json())["data"]]
        assert (await post(load, {"lora_name": "swap", "lora_path": swap}))[0] == 200
        assert (await post(load, {"lora_name": "late", "lora_path": late}))[0] == 200
        out["swap1"] = await post("/v1/completions", {**body, "model": "swap"})
        garbage = struct.pack("<Q", 20000) + b"[" * 10000 + b"]" * 10000
        for path in (swap, late):
            with open(f"{path}/adapter_model.safetensors", "wb") as f:
                f.write(garbage)
        out["swap2"] = await post("/v1/completions", {**body, "model": "swap"})
        out["late"] = await post("/v1/completions", {**body, "model": "late"})
        out["base"] = await post("/v1/completions", body)
        return out

    out = run_in_process(engine, options, script)
    for name, (_, why) in bad.items():
        status, err = out[name]
        assert status == 400 and err["param"] == "lora_path" and why in err["message"], err
    expect = {"surrogate": (None, "the \\u escape at character 15 is a lone surrogate"),
              "control": ("lora_name", "lora_name has U+0007 at index 1"),
              "long_name": ("lora_name", "lora_name is 300 characters long; the limit is 256"),
              "long_path": ("lora_path", "lora_path is 100000 bytes long; the limit is 4096"),
              "nul_path": ("lora_path", "lora_path has the control character U+0000"),
              "deep_body": (None, "the request body is nested too deeply: arrays and objects "
                                  "may be nested at most 128 levels"),
              "unload": ("lora_name", "lora_name has U+001B at index 0")}
    for name, (param, why) in expect.items():
        status, err = out[name]
        assert status == 400 and err["param"] == param and why in err["message"], (name, err)
    assert out["models"] == (200, [str(tiny)])
    for name in ("swap1", "swap2"):  # loaded with the first request, kept since
        assert json.loads(out[name][1])["choices"][0]["text"] == offline["sql"]
    status, err = out["late"]
    assert status == 400 and err["param"] == "model", err
    assert err["message"].startswith("the LoRA adapter 'late' cannot be loaded: ")
    assert json.loads(out["base"][1])["choices"][0]["text"] == offline[None]


async def _health_while(client, request) -> tuple[int, list[float]]:
    """Poll /health until ``request`` (a coroutine) is answered: its status and the
    latencies."""
    task = asyncio.ensure_future(request)
    latencies = []
    while not task.done():
        t0 = time.monotonic()
        assert (await client.get("/health")).status == 200
        latencies.append(time.monotonic() - t0)
        await asyncio.sleep(0.01)
    return (await task).status, latencies


def test_health_answers_while_an_adapter_is_checked(tiny, adapters, tmp_path, monkeypatch):
    """An adapter's files are read and checked off the event loop: /health answers within
    100 ms while a slow check runs, and a 48 MB safetensors header is refused at once (it
    is past the size an adapter of the model can have) without being parsed. The best of
    three runs counts, as in test_hardening.py."""
    from pagedserve.server import lora as server_lora

    real = server_lora.check_adapter
    monkeypatch.setattr(server_lora, "check_adapter",
                        lambda *a: time.sleep(0.5) or real(*a))  # a slow disk
    pad = b"0," * (24 * 2**20)
    header = b'{"__metadata__": {"pad": [' + pad + b'0]}}'
    huge, size = _copy(adapters["sql"], tmp_path / "huge", header=header), len(header)
    del pad, header
    engine = _engine(tiny, enable_lora=True, max_lora_rank=8)
    options = ServeOptions(allow_runtime_lora_updating=True)

    async def script(client):
        runs = {"slow": [], "huge": []}
        for i in range(3):
            for case, path in (("slow", str(adapters["sql"])), ("huge", huge)):
                runs[case].append(await _health_while(client, client.post(
                    "/v1/load_lora_adapter", json={"lora_name": f"{case}{i}",
                                                   "lora_path": path})))
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "h",
                                                             "lora_path": huge})
        return runs, await r.json()

    runs, err = run_in_process(engine, options, script)
    assert [s for s, _ in runs["slow"]] == [200] * 3 and [s for s, _ in runs["huge"]] == [400] * 3
    assert err["error"]["param"] == "lora_path"
    assert f"has a safetensors header of {size} bytes; the limit for an adapter of this " \
        "model is 1077248 bytes" in err["error"]["message"]  # fmt: skip
    for case, results in runs.items():
        worst = [max(lat, default=0.0) for _, lat in results]
        assert min(worst) < 0.1, (case, worst)
    assert min(len(lat) for _, lat in runs["slow"]) >= 3
