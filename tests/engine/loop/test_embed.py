"""Embeddings (``LLM.embed``): the pooled final hidden states equal HF transformers'
``AutoModel`` ``last_hidden_state`` pooled the same way (last token, mean, first token),
cut to ``dimensions`` and normalized; chunked, prefix-cached and batched beside
generation alike; the model's sentence-transformers pooling is its default."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedserve import (
    LLM,
    EngineConfig,
    EngineInputError,
    InputField,
    PoolingParams,
    SamplingParams,
)
from pagedserve.engine.core.pooling import pooling_defaults
from pagedserve.engine.loop.llm_engine import LLMEngine

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b",
         "A long sentence about the sea, the sky, the wind and the waves that goes on and on "
         "for a while so that it spans several blocks and chunks of the prompt."]


def hf_pooled(path, prompts: list[list[int]], kind: str, normalize: bool = True,
              dims: int | None = None) -> list[torch.Tensor]:  # fmt: skip
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            v = {"LAST": h[-1], "MEAN": h.mean(dim=0), "CLS": h[0]}[kind]
            v = v[:dims] if dims else v
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [default_tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind, normalize, dims", [("LAST", True, None), ("MEAN", True, None),
                                                   ("CLS", False, None), ("LAST", True, 16),
                                                   ("MEAN", False, 8)])
def test_embeddings_equal_hf(tiny_model_factory, prompts, arch, kind, normalize, dims):
    path = tiny_model_factory(arch)
    want = hf_pooled(path, prompts, kind, normalize, dims)
    # A small budget chunks the long prompt; prefix caching on.
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, block_size=8)
    params = PoolingParams(pooling_type=kind, normalize=normalize, dimensions=dims)
    for _ in range(2):  # the second time the prompts' blocks are cached
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for o, w in zip(outs, want, strict=True):
            assert o.finished and o.outputs[0].token_ids == []
            assert len(o.embedding) == (dims or 64) and close(o.embedding, w)
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks
    hits = llm.engine.kv.num_prefix_cache_hits
    assert (hits > 0) == (kind == "LAST")  # the other poolings need every token's state


def test_embeddings_batch_beside_generation(tiny_model_factory, prompts):
    path = tiny_model_factory("llama")
    want = hf_pooled(path, prompts, "MEAN")
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", max_num_batched_tokens=16))
    gen = [eng.add_request(None, p, SamplingParams(max_tokens=12, temperature=0.0,
                                                   ignore_eos=True)).request_id
           for p in prompts]  # fmt: skip
    emb = [eng.add_request(None, p, SamplingParams(max_tokens=0),
                           pooling=PoolingParams(pooling_type="MEAN")).request_id
           for p in prompts]  # fmt: skip
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    for rid, w in zip(emb, want, strict=True):
        assert close(done[rid].embedding, w)
    assert all(len(done[rid].outputs[0].token_ids) == 12 and done[rid].embedding is None
               for rid in gen)  # fmt: skip


def test_the_models_sentence_transformers_pooling_is_the_default(tiny_model_factory,
                                                                 prompts, tmp_path):  # fmt: skip
    import shutil

    path = tmp_path / "st"
    shutil.copytree(tiny_model_factory("qwen3"), path)
    assert pooling_defaults(path) == PoolingParams()
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    assert pooling_defaults(path) == PoolingParams(pooling_type="MEAN", normalize=False)
    llm = LLM(str(path), dtype="float32")
    out = llm.embed([{"prompt_token_ids": prompts[0]}], use_tqdm=False)[0]
    assert close(out.embedding, hf_pooled(path, prompts[:1], "MEAN", normalize=False)[0])


def test_bad_pooling_parameters_name_the_field(tiny_model_factory, prompts):
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32")
    for params, field, why in ((PoolingParams(dimensions=65), InputField.DIMENSIONS,
                                "dimensions=65 is invalid: must be an integer in [1, 64]"),
                               (PoolingParams(dimensions=0), InputField.DIMENSIONS, "[1, 64]"),
                               (PoolingParams(pooling_type="max"), InputField.POOLING_TYPE,
                                "pooling_type='max' is invalid")):  # fmt: skip
        with pytest.raises(EngineInputError) as e:
            llm.embed([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        assert e.value.field is field and why in str(e.value)
    eng = llm.engine
    for params, field, why in ((SamplingParams(max_tokens=0, n=2), InputField.N, "n=2"),
                               (SamplingParams(max_tokens=4), InputField.MAX_TOKENS,
                                "max_tokens=4 is invalid for an embedding request")):  # fmt: skip
        with pytest.raises(EngineInputError) as e:
            eng.add_request(None, prompts[0], params, pooling=PoolingParams())
        assert e.value.field is field and why in str(e.value)
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks
