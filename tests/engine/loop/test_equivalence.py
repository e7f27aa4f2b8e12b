"""Greedy outputs equal HF transformers ``generate(do_sample=False)`` token for token."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.helpers.hf import hf_greedy
from tests.helpers.prompts import PROMPTS, default_prompt_ids

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def default_prompts(default_tokenizer):
    return default_prompt_ids(default_tokenizer)


@pytest.fixture(scope="module")
def default_reference(default_model_path, default_prompts):
    return hf_greedy(default_model_path, default_prompts, NEW_TOKENS)


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    # min_tokens masks EOS exactly as HF min_new_tokens does.
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def run(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


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
    llm = LLM(quantization="gguf", max_num_batched_tokens=24, enable_prefix_caching=False,
              attention_backend=backend)
    assert llm.engine.worker.quant_desc == "gguf (q4_1, q8_0)"
    assert run(llm, default_prompts) == default_reference
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


GGUF_FILES = {
    "q8_0": "gguf (q8_0)",
    "q4_0": "gguf (q4_0)",
    "q5_0": "gguf (q5_0)",
    "q5_1": "gguf (q5_1)",
    "q4_k_m": "gguf (q4_k, q5_0, q6_k, q8_0)",
    "q5_k_m": "gguf (q5_1, q5_k, q6_k, q8_0)",
    "q6_k": "gguf (q6_k, q8_0)",
}
"""The default model's GGUF files made by ``loadtest.gguf_requant`` and the formats the
engine keeps them in. The K-quant recipes hold K-quants only in ``ffn_down`` (the one
weight whose rows are whole 256-weight blocks) and their fallbacks elsewhere."""


@pytest.mark.parametrize("fmt", list(GGUF_FILES))
def test_a_gguf_file_served_in_its_own_format_matches_hf_on_that_file(
        fmt, tmp_path, monkeypatch, default_prompts):  # fmt: skip
    """Any GGUF file as the model: the default model's re-encoded in ``fmt`` (a single
    type for every linear and the embedding, or llama-quantize's Q4_K_M, Q5_K_M or Q6_K
    mix), served from its own blocks, equals HF transformers on the same file (the folder
    it converts to)."""
    import gguf

    from pagedserve.engine import envs
    from pagedserve.engine.loader import default_gguf_path, resolve_model_path
    from pagedserve.loadtest.gguf_requant import FILE_TYPES, requantize

    monkeypatch.setenv(envs.CACHE.name, str(tmp_path / "cache"))
    path = tmp_path / f"SmolLM2-135M-Instruct.{fmt.upper()}.gguf"
    assert requantize(default_gguf_path(), path, fmt) > 0
    file_type = gguf.GGUFReader(str(path)).fields["general.file_type"].contents()
    assert file_type == FILE_TYPES[fmt.upper()]
    llm = LLM(model=str(path), quantization="gguf", max_num_batched_tokens=24)
    assert llm.engine.worker.quant_desc == GGUF_FILES[fmt]
    want = hf_greedy(resolve_model_path(str(path)), default_prompts[:4], 32)
    assert run(llm, default_prompts[:4], 32) == want


def test_gguf_prefill_chunks_of_hundreds_of_rows_match_hf(default_model_path, default_tokenizer):
    """Prompts of 300-1,000 tokens, each prefilled in one chunk (one request a step):
    chunks the quantized kernel multiplies in registers up to its row limit (1,024 on
    AVX-512) and that dequantize the weights above it. Equal to HF transformers on the
    same GGUF token for token."""
    text = " ".join(PROMPTS)
    ids = default_tokenizer.encode(" ".join([text] * 40))
    prompts = [ids[:n] for n in (300, 700, 1000)]
    assert all(len(p) == n for p, n in zip(prompts, (300, 700, 1000), strict=True))
    llm = LLM(quantization="gguf", enable_prefix_caching=False)
    got = [run(llm, [p], 16)[0] for p in prompts]
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks
    del llm
    assert got == hf_greedy(default_model_path, prompts, 16)
