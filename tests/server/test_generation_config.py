"""A model's ``generation_config.json`` sampling fields are the defaults of requests
that leave them unset (``--generation-config auto``, as in vLLM), offline and on the
server; ``--generation-config vllm`` keeps the engine's own."""

from __future__ import annotations

import json

import pytest

from pagedserve import LLM, EngineConfig, SamplingParams
from pagedserve.engine.loop.engine_info import generation_defaults
from pagedserve.engine.loop.llm_engine import LLMEngine
from pagedserve.server.options import ServeOptions
from pagedserve.server.params import chat_params
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage
from tests.helpers.server import run_in_process


def test_generation_defaults_reads_the_sampling_fields_only(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None, "do_sample": True,
        "repetition_penalty": 1.05, "max_new_tokens": 100, "eos_token_id": [1, 2]}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                             "repetition_penalty": 1.05}


def test_a_requests_own_values_win():
    msgs = [ChatMessage("user", "hi")]
    defaults = {"temperature": 0.6, "top_k": 20}
    p, _ = chat_params(ChatCompletionRequest(messages=msgs), None, defaults)
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 20, 1.0)
    p, _ = chat_params(ChatCompletionRequest(messages=msgs, temperature=1.5, top_k=0), None,
                       defaults)
    assert (p.temperature, p.top_k) == (1.5, 0)


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory, default_model_path, make_tiny):
    """A tiny model whose generation config says greedy."""
    path = make_tiny("llama", tmp_path_factory.mktemp("gen-config"), default_model_path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                             "eos_token_id": 2}))
    return path


def test_offline_defaults(greedy_model):
    llm = LLM(model=str(greedy_model), dtype="float32", kv_cache_memory_gb=0.02)
    assert llm.get_default_sampling_params().temperature == 0.0
    plain = llm.generate(["a b c"], use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate(["a b c"], SamplingParams(temperature=0), use_tqdm=False)
    assert plain == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_server_defaults(greedy_model, mode):
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(greedy_model), dtype="float32",
                                                kv_cache_memory_gb=0.02))
    body = {"prompt": "a b c", "max_tokens": 8, "seed": 3, "ignore_eos": True}

    async def script(client):
        texts = []
        for extra in ({}, {"temperature": 0}, {"temperature": 1.0}):
            r = await client.post("/v1/completions", json={**body, **extra})
            texts.append((await r.json())["choices"][0]["text"])
        return texts

    unset, greedy, sampled = run_in_process(engine, ServeOptions(generation_config=mode),
                                            script)
    assert greedy != sampled  # the tiny model's sampled text is not its greedy text
    assert unset == (greedy if mode == "auto" else sampled)
