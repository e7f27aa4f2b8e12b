"""``kv_cache_dtype``: a 16-bit KV cache under a float32 model holds twice the tokens in
the same memory, an 8-bit one (codes and a float32 scale a row) 256/68 times as many
with the default model's 64-wide heads; the native kernels and the torch reference read
the same rounded or quantized K/V (the same greedy tokens), and bad values are refused
by name."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, EngineConfig, SamplingParams
from pagedserve.engine.worker.settings import resolve_kv_cache_dtype
from tests.helpers.prompts import PROMPTS

NEW_TOKENS = 32


def _greedy(llm: LLM, prompts: list[list[int]], logprobs: int | None = None) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            logprobs=logprobs)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if logprobs:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return [o.outputs[0].token_ids for o in outs]


QUANTIZED_KV_TIE = 0.25
"""How far apart (in logprob) the reference's two best tokens may be where another path
picks the second. Rounding K/V to 8 bits turns the linears' float32 differences between
backends (1e-5 of a logprob with a float32 cache) into different codes at rounding
boundaries: the default model's first-token logprobs then differ by up to 0.08 between
the native and the torch path, on AVX2 and AVX-512 alike."""


def assert_same_greedy_up_to_ties(ref: list, got: list[list[int]], tie: float) -> None:
    """``got``'s tokens equal the reference's (``_greedy`` with logprobs=2) up to the
    first step where the two differ, if any; there the reference's two best tokens are
    within ``tie`` of each other and ``got`` took the second: a near tie, not an error."""
    for i, ((want, logprobs), seq) in enumerate(zip(ref, got, strict=True)):
        step = next((j for j, (a, b) in enumerate(zip(want, seq, strict=True)) if a != b), None)
        if step is None:
            continue
        best = sorted(logprobs[step].items(), key=lambda kv: -kv[1].logprob)[:2]
        gap = best[0][1].logprob - best[1][1].logprob
        assert seq[step] == best[1][0] and gap < tie, (
            f"prompt {i}: token {step} is {seq[step]}, the reference's {want[step]} by "
            f"{gap:.3f} (its two best: {[t for t, _ in best]})")


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [default_tokenizer.encode(p) for p in PROMPTS]


def test_a_16bit_cache_holds_twice_the_tokens():
    wide = LLM(dtype="float32", kv_cache_memory_gb=0.125)
    narrow = LLM(dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory_gb=0.125)
    assert wide.engine.worker.kv_cache.dtype == torch.float32
    assert narrow.engine.worker.kv_cache.dtype == torch.bfloat16
    assert narrow.engine.settings.dtype == torch.float32  # the model stays float32
    assert narrow.engine.kv.num_blocks == 2 * wide.engine.kv.num_blocks
    assert narrow.engine.worker.kv_cache.nbytes == wide.engine.worker.kv_cache.nbytes


def test_an_int8_cache_holds_256_68ths_the_tokens():
    wide = LLM(dtype="float32", kv_cache_memory_gb=0.125)
    narrow = LLM(dtype="float32", kv_cache_dtype="int8", kv_cache_memory_gb=0.125)
    cache = narrow.engine.worker.kv_cache
    assert cache.dtype == torch.int8 and cache.shape[-1] == 64 + 4
    assert narrow.engine.worker.block_bytes() * 256 == wide.engine.worker.block_bytes() * 68
    assert narrow.engine.kv.num_blocks == wide.engine.kv.num_blocks * 256 // 68
    assert cache.nbytes <= wide.engine.worker.kv_cache.nbytes


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "int8"])
def test_native_and_reference_backends_agree(kv_dtype, prompts):
    # A small token budget chunks the long prompts and mixes decodes with prefill
    # chunks; whole prompts in one step take the reference's causal path, which must
    # also attend to the rounded K/V.
    # The reference: torch, whole prompts. Every other path's greedy tokens equal its own
    # up to a near tie (an 8-bit cache: see QUANTIZED_KV_TIE; 16-bit caches, exactly).
    outs = {}
    for backend in ("torch", "cpu"):
        for budget in (2048, 24):
            llm = LLM(dtype="float32", kv_cache_dtype=kv_dtype, attention_backend=backend,
                      max_num_batched_tokens=budget, enable_prefix_caching=False)
            assert llm.engine.worker.attn.name == backend
            first = not outs
            outs[backend, budget] = _greedy(llm, prompts, logprobs=2 if first else None)
            assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks
    ref = outs.pop(("torch", 2048))
    for path, got in outs.items():
        if kv_dtype == "int8":
            assert_same_greedy_up_to_ties(ref, got, QUANTIZED_KV_TIE)
        else:
            assert got == [seq for seq, _ in ref], path


@pytest.mark.parametrize("arch", ["gemma2", "mistral_window", "gemma3_6"])
def test_an_int8_cache_under_windows_and_soft_caps(tiny_model_factory, arch, prompts):
    # Sliding windows (Gemma 3's windowed KV groups too) and soft caps over an int8
    # cache: the native kernels and the torch reference, chunked and whole, agree.
    path = str(tiny_model_factory(arch))
    outs = {}
    for backend in ("cpu", "torch"):
        for budget in (24, 2048):
            with LLM(path, dtype="float32", kv_cache_dtype="int8", attention_backend=backend,
                     max_num_batched_tokens=budget, enable_prefix_caching=False) as llm:
                assert llm.engine.worker.kv_cache.dtype == torch.int8
                outs[backend, budget] = _greedy(llm, prompts)
                assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks
    assert outs["cpu", 24] == outs["torch", 24] == outs["cpu", 2048] == outs["torch", 2048]


def test_bad_values_name_the_parameter():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is invalid: .*'bfloat16'.*"
                                         r"fp8 KV caches are not supported"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' is invalid: must be one of"):
        LLM(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is a CPU cache: the triton"):
        resolve_kv_cache_dtype("int8", torch.float16, "triton")
    assert resolve_kv_cache_dtype("int8", torch.float32, "torch") == torch.int8
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' differs from the model "
                                         r"dtype float32: the triton attention backend"):
        resolve_kv_cache_dtype("bfloat16", torch.float32, "triton")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "triton") == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, "triton") == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32, "cpu") == torch.float16
