"""Phi-3 (``Phi3ForCausalLM``): checkpoints with fused ``qkv_proj`` and ``gate_up_proj``,
a sliding window, a context capped where longrope's long factors would begin, greedy
output equal to HF transformers, and what such a model refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedserve import LLM, SamplingParams
from pagedserve.engine.models.spec import DecoderSpec
from pagedserve.engine.worker.settings import check_moe
from tests.helpers.hf import hf_greedy

WORDS = "the quick brown fox jumps over the lazy dog and keeps running far away".split()


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(" ".join(WORDS[: 3 + 4 * i])) for i in range(4)]


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n),
                        use_tqdm=False)  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


def _filling(prompts: list[list[int]], length: int) -> list[list[int]]:
    """``prompts`` and one more whose ``length`` tokens, with the output, fill the
    context."""
    ids = [t for p in prompts for t in p] * 8
    return [*prompts, ids[:length]]


def _variant(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_equals_hf(backend, tiny_model_factory, prompts):
    path = tiny_model_factory("phi3")
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02, attention_backend=backend,
              max_num_batched_tokens=24)  # chunked prefills beside decodes
    assert greedy(llm, prompts, 16) == hf_greedy(path, prompts, 16)
    # The fused checkpoint tensors land whole in the engine's fused projections.
    stored = load_file(str(path / "model.safetensors"))
    layer = llm.engine.worker.model.layers[1]
    assert torch.equal(layer.qkv_proj.weight, stored["model.layers.1.self_attn.qkv_proj.weight"])
    assert torch.equal(layer.gate_up_proj.weight, stored["model.layers.1.mlp.gate_up_proj.weight"])


def test_sliding_window_serves_past_the_window(tiny_model_factory, prompts, tmp_path):
    path = _variant(tiny_model_factory("phi3"), tmp_path / "windowed", sliding_window=24)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02)
    assert llm.engine.settings.max_model_len == 1024  # max_position_embeddings
    assert llm.engine.worker.model.spec.windows == (24, 24)
    assert llm.engine.kv.windows == (24,)  # one KV group, which drops what the window left
    # Prompts and outputs well past the window slide as HF's do.
    ask = _filling(prompts, 70)
    assert greedy(llm, ask, 12) == hf_greedy(path, ask, 12)


def test_longrope_runs_its_short_factors_up_to_the_original_length(tiny_model_factory,
                                                                   prompts, tmp_path):
    head_half = 64 // 4 // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(head_half)],
            "long_factor": [2.0 + 0.5 * i for i in range(head_half)],
            "original_max_position_embeddings": 64}
    path = _variant(tiny_model_factory("phi3"), tmp_path / "longrope", rope_parameters=rope,
                    original_max_position_embeddings=64)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02)
    assert llm.engine.settings.max_model_len == 64
    ask = _filling(prompts, 64 - 16)  # positions up to 63: the short factors throughout
    assert greedy(llm, ask, 16) == hf_greedy(path, ask, 16)
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=64"):
        LLM(str(path), kv_cache_memory_gb=0.02, max_model_len=65)


def test_tp2_equals_tp1(tiny_model_factory, prompts):
    path = str(tiny_model_factory("phi3"))
    engine = dict(dtype="float32", max_num_batched_tokens=32, kv_cache_memory_gb=0.02)
    with LLM(path, **engine) as one:
        ref = greedy(one, prompts, 12)
    with LLM(path, tensor_parallel_size=2, **engine) as two:
        assert two.engine.worker.model.layers[0].qkv_proj.weight.shape[0] == (4 + 2 * 2) * 16 // 2
        assert greedy(two, prompts, 12) == ref


def test_int8_and_refusals(tiny_model_factory, prompts, tmp_path):
    path = tiny_model_factory("phi3")
    llm = LLM(str(path), quantization="int8", kv_cache_memory_gb=0.02)
    assert len(greedy(llm, prompts[:1], 4)[0]) == 4
    spec = DecoderSpec.from_hf(_hf_config(path))
    assert spec.fused_checkpoint
    for quantization in ("gguf", "gptq", "awq"):
        with pytest.raises(ValueError, match=rf"quantization='{quantization}' is not supported "
                                             "for Phi-3 models"):  # fmt: skip
            check_moe(spec, quantization)
    with pytest.raises(ValueError, match="a GGUF file is not supported for Phi-3 models"):
        check_moe(spec, None, gguf_file=True)  # its converted config has no longrope
    partial = _variant(path, tmp_path / "partial", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.75 is not supported"):
        LLM(str(partial), kv_cache_memory_gb=0.02)
    short = load_file(str(path / "model.safetensors"))
    short["model.layers.0.mlp.gate_up_proj.weight"] = short[
        "model.layers.0.mlp.gate_up_proj.weight"][:-1]
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    from safetensors.torch import save_file

    save_file(short, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_up_proj.weight' has 255 "
                                         r"rows; the config's sizes give 256"):
        LLM(str(broken), kv_cache_memory_gb=0.02)


@pytest.mark.parametrize(("config", "limit", "why"), [
    # Phi-3-mini-4k: a 2,047-token window (it slides: the whole 4k is served);
    # Phi-3.5-mini: longrope, a window of 262,144.
    (dict(model_type="phi3", max_position_embeddings=4096, sliding_window=2047), 4096,
     "max_position_embeddings=4096"),
    (dict(model_type="phi3", max_position_embeddings=131072, sliding_window=262144,
          original_max_position_embeddings=4096,
          rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                        "long_factor": [2.0] * 48}), 4096,
     "original_max_position_embeddings=4096"),
    (dict(model_type="mistral", max_position_embeddings=32768, sliding_window=4096), 32768,
     "max_position_embeddings=32768"),  # Mistral 7B v0.1: its 4k window slides
    (dict(model_type="mistral", max_position_embeddings=32768, sliding_window=None), 32768,
     "max_position_embeddings=32768"),  # v0.2, v0.3
    (dict(model_type="qwen2", max_position_embeddings=32768, sliding_window=131072,
          use_sliding_window=False), 32768, "max_position_embeddings=32768"),  # Qwen2.5
    (dict(model_type="qwen2", max_position_embeddings=32768, sliding_window=4096,
          use_sliding_window=True, max_window_layers=2, num_hidden_layers=2), 32768,
     "max_position_embeddings=32768"),  # every layer below max_window_layers: none slides
    (dict(model_type="llama", max_position_embeddings=8192), 8192,
     "max_position_embeddings=8192"),
])
def test_position_limit_of_known_configs(config, limit, why):
    import transformers

    from pagedserve.engine.models.spec import position_limit

    cfg = transformers.AutoConfig.for_model(**config)
    got = position_limit(cfg)
    assert got[0] == limit and got[1].startswith(why), got


def _hf_config(path: Path):
    import transformers

    return transformers.AutoConfig.from_pretrained(path)
