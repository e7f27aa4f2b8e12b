"""A GGUF file named by path is served in its own blocks on the CPU unless the user asks
for something else (``resolve_settings``' ``gguf_by_default``)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.loader import default_gguf_path
from pagedserve.engine.worker.settings import gguf_by_default

CPU = torch.device("cpu")


ZEN5 = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
SPR = ZEN5 | {"amx_bf16", "amx_tile"}


@pytest.mark.parametrize(("kwargs", "device", "level", "bf16", "feats", "want"), [
    ({}, CPU, "avx2", False, frozenset(), True),
    ({}, CPU, "avx512", False, frozenset(), True),
    ({}, CPU, "portable", False, frozenset(), False),  # float activations: slower from 32 rows
    ({}, CPU, "avx512", True, ZEN5, True),  # 512-bit VNNI dots: faster than bfloat16 (A16)
    ({}, CPU, "avx2", True, ZEN5, False),  # a lower build on that CPU: not measured
    ({}, CPU, "avx512", True, ZEN5 - {"avx512_vnni"}, False),
    ({}, CPU, "avx512", True, SPR, False),  # against AMX's bfloat16 tiles: not measured
    ({"dtype": "float32"}, CPU, "avx2", False, frozenset(), False),  # a dtype: expanded
    ({"dtype": "bfloat16"}, CPU, "avx512", True, ZEN5, False),
    ({"quantization": "gguf"}, CPU, "avx2", False, frozenset(), False),  # given: no default
    ({"tensor_parallel_size": 2}, CPU, "avx2", False, frozenset(), False),  # gguf: one rank
    ({}, torch.device("cuda"), "avx2", False, frozenset(), False),
])  # fmt: skip
def test_when_a_gguf_file_defaults_to_its_own_blocks(kwargs, device, level, bf16, feats, want):
    config = EngineConfig(model="/models/x.Q4_K_M.gguf", **kwargs)
    assert gguf_by_default(config, device, cpu_level=level, cpu_native_bf16=bf16,
                           cpu_features=feats) is want  # fmt: skip


def test_a_folder_and_the_embedded_default_keep_float():
    for config in (EngineConfig(model="/models/llama"), EngineConfig()):
        assert not gguf_by_default(config, CPU, cpu_level="avx2", cpu_native_bf16=False)


def test_a_gguf_path_without_quantization_serves_its_blocks():
    """What a user passing only a file gets on this CPU: its own blocks where the default
    applies here (the worker's description says so), and the same greedy tokens as
    quantization='gguf'."""
    from pagedserve import LLM, SamplingParams

    path = default_gguf_path()
    applies = gguf_by_default(EngineConfig(model=str(path)), CPU)
    sp = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["The capital of France is", "1, 2, 3,"]
    with LLM(str(path), device="cpu", kv_cache_memory_gb=0.05) as llm:
        assert llm.engine.worker.settings.quantization == ("gguf" if applies else None)
        if not applies:
            return  # served expanded, as before (the conversion's own tests)
        assert llm.engine.worker.quant_desc == "gguf (q4_1, q8_0)"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    with LLM(str(path), quantization="gguf", device="cpu", kv_cache_memory_gb=0.05) as given:
        assert [o.outputs[0].token_ids for o in given.generate(prompts, sp)] == got


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
    monkeypatch.setattr(settings_mod, "gguf_by_default", lambda *a, **k: True)
    got = settings_mod.resolve_settings(EngineConfig(model="/models/moe.gguf", device="cpu"))
    assert asked == [False, True]  # the header first, then the whole file
    assert got.quantization is None  # and the float dtype this CPU computes in
    assert got.dtype == settings_mod.resolve_dtype("auto", got.hf_config, CPU)
    assert got.config.quantization is None  # the settings as given


def test_a_gguf_file_without_kept_quantized_tensors_is_expanded(gemma3_gguf, monkeypatch):
    """A file whose tensors are all in formats the engine does not keep (this one float32)
    is served expanded even where the default applies: the same model, the same greedy
    tokens as asking for its dtype."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.worker import settings as settings_mod

    real = settings_mod.gguf_by_default
    assert real(EngineConfig(model=str(gemma3_gguf)), CPU, cpu_level="avx2", cpu_native_bf16=False)
    # The default as an AVX2 CPU without bfloat16 answers it (a dtype still turns it off).
    monkeypatch.setattr(settings_mod, "gguf_by_default", lambda config, device: real(
        config, device, cpu_level="avx2", cpu_native_bf16=False))
    sp = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["The capital of France is", "1, 2, 3,"]
    with LLM(str(gemma3_gguf), device="cpu", kv_cache_memory_gb=0.05) as llm:
        got = llm.engine.worker.settings
        assert got.quantization is None and got.config.quantization is None
        assert llm.engine.worker.quant_desc is None
        assert got.dtype == settings_mod.resolve_dtype("auto", got.hf_config, CPU)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    dtype = str(got.dtype).removeprefix("torch.")
    with LLM(str(gemma3_gguf), device="cpu", dtype=dtype, kv_cache_memory_gb=0.05) as given:
        assert [o.outputs[0].token_ids for o in given.generate(prompts, sp)] == tokens
    assert all(len(t) == 8 for t in tokens)
