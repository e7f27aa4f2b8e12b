"""Greedy outputs equal HF transformers ``generate(do_sample=False)`` token for token
(GGUF files in other formats: ``test_gguf_files.py``)."""

from __future__ import annotations

import pytest

from pagedserve import LLM
from tests.helpers.hf import greedy_tokens, hf_greedy
from tests.helpers.prompts import default_prompt_ids

NEW_TOKENS = 64

SCHEDULE_FIRST = True
"""Among the longest modules of the suite: started first (``tests/conftest.py``)."""


@pytest.fixture(scope="module")
def default_prompts(default_tokenizer):
    return default_prompt_ids(default_tokenizer)


@pytest.fixture(scope="module")
def default_reference(default_model_path, default_prompts):
    return hf_greedy(default_model_path, default_prompts, NEW_TOKENS)


def run(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    return greedy_tokens(llm, prompts, n)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_default_model_matches_hf_chunked_mixed_batch(backend, default_prompts,
                                                      default_reference):  # fmt: skip
    assert any(len(p) > 3 * 16 for p in default_prompts)
    # A small token budget chunks the long prompts and mixes decodes with prefill chunks.
    llm = LLM(dtype="float32", max_num_batched_tokens=24, enable_prefix_caching=False, attention_backend=backend)
    # auto on the CPU is the native decode kernel; torch is the fallback without a compiler.
    assert llm.engine.worker.attn.name == ("cpu" if backend == "auto" else "torch")
    assert run(llm, default_prompts) == default_reference
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


def test_default_model_matches_hf_under_preemption(default_prompts, default_reference):
    # 40 blocks of 16 tokens cannot hold 9 requests of ~90-130 tokens at once.
    llm = LLM(dtype="float32", num_gpu_blocks_override=40, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert run(llm, default_prompts) == default_reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.stats().num_free_blocks == 40


def test_default_model_unchunked_and_batch_size_one(default_prompts, default_reference):
    llm = LLM(dtype="float32", enable_chunked_prefill=False, max_num_seqs=1, max_model_len=2048)
    assert run(llm, default_prompts) == default_reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf(arch, tiny_model_factory, default_tokenizer):
    path = tiny_model_factory(arch)
    words = "the quick brown fox jumps over the lazy dog and keeps running far away".split()
    prompts = [default_tokenizer.encode(" ".join(words[: 3 + 5 * i]) * (1 + i)) for i in range(6)]
    prompts = [p if len(p) % 16 else p[:-1] for p in prompts]
    assert all(len(p) % 16 for p in prompts), [len(p) for p in prompts]
    ref = hf_greedy(path, prompts, 32)
    for kwargs in ({"max_num_batched_tokens": 16}, {"max_num_seqs": 16},
                   {"num_gpu_blocks_override": 12, "max_num_batched_tokens": 32},
                   {"enable_chunked_prefill": False, "max_num_seqs": 1}):
        llm = LLM(model=str(path), dtype="float32", enable_prefix_caching=False, **kwargs)
        assert run(llm, prompts, 32) == ref, kwargs


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gguf_quantized_default_model_matches_hf_on_the_gguf(backend, default_prompts,
                                                             default_reference):  # fmt: skip
    """The default model served from its GGUF's own Q4_1/Q8_0 weights (never expanded)
    equals HF transformers on the same GGUF (which dequantizes it to float32: the
    converted folder) token for token, chunked and batched."""
    llm = LLM(quantization="gguf", quantized_activations="float", max_num_batched_tokens=24, enable_prefix_caching=False,
              attention_backend=backend)
    assert llm.engine.worker.quant_desc == "gguf (q4_1, q8_0)"
    assert run(llm, default_prompts) == default_reference
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks
