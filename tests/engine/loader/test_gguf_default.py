"""A GGUF file named by path is served in its own blocks on the CPU unless the user asks
for something else (``resolve_settings``' ``gguf_by_default``)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.loader import default_gguf_path
from pagedserve.engine.worker.settings import gguf_by_default

CPU = torch.device("cpu")


@pytest.mark.parametrize(("kwargs", "device", "want"), [
    ({}, CPU, True),
    ({"dtype": "float32"}, CPU, False),  # a dtype asks for the weights expanded to it
    ({"dtype": "bfloat16"}, CPU, False),
    ({"quantization": "gguf"}, CPU, False),  # given: nothing to default
    ({"tensor_parallel_size": 2}, CPU, False),  # gguf runs on one rank
    ({}, torch.device("cuda"), False),
])  # fmt: skip
def test_when_a_gguf_file_defaults_to_its_own_blocks(kwargs, device, want):
    config = EngineConfig(model="/models/x.Q4_K_M.gguf", **kwargs)
    assert gguf_by_default(config, device) is want


def test_a_folder_and_the_embedded_default_keep_float():
    assert not gguf_by_default(EngineConfig(model="/models/llama"), CPU)
    assert not gguf_by_default(EngineConfig(), CPU)


def test_a_gguf_path_without_quantization_serves_its_blocks():
    """What a user passing only a file gets: its own blocks (the paths line says so), the
    same greedy tokens as quantization='gguf', and a dtype expands it as before."""
    from pagedserve import LLM, SamplingParams

    path = default_gguf_path()
    sp = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["The capital of France is", "1, 2, 3,"]
    llm = LLM(str(path), kv_cache_memory_gb=0.05)
    assert llm.engine.worker.settings.quantization == "gguf"
    assert llm.engine.worker.quant_desc == "gguf (q4_1, q8_0)"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    del llm
    given = LLM(str(path), quantization="gguf", kv_cache_memory_gb=0.05)
    assert [o.outputs[0].token_ids for o in given.generate(prompts, sp)] == got
    del given
    expanded = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05)
    assert expanded.engine.worker.settings.quantization is None
    assert expanded.engine.worker.quant_desc is None


def test_a_gguf_file_with_experts_is_expanded(tiny_model_factory, monkeypatch):
    """The default looks at the header's model first: one with experts (which the GGUF
    blocks do not serve) is converted whole and served in float, as before."""
    from pagedserve.engine.worker import settings as settings_mod

    folder = tiny_model_factory("qwen2_moe")
    asked = []

    def resolve(model, revision=None, weights=True):
        asked.append(weights)
        return folder

    monkeypatch.setattr(settings_mod, "resolve_model_path", resolve)
    got = settings_mod.resolve_settings(EngineConfig(model="/models/moe.gguf", device="cpu"))
    assert asked == [False, True]  # the header first, then the whole file
    assert got.quantization is None  # and the float dtype this CPU computes in
    assert got.dtype == settings_mod.resolve_dtype("auto", got.hf_config, CPU)
    assert got.config.quantization is None  # the settings as given
