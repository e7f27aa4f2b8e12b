"""A request whose logits stop being finite ends with an error; the others of its steps
run on unharmed."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.sampler import tokens_and_nonfinite
from tests.helpers.models import write_tiny_model


def test_rows_whose_chosen_logit_is_not_finite_are_named() -> None:
    raw = torch.randn(5, 11)
    raw[1] = float("nan")  # every logit NaN: no meaningful argmax
    raw[3, 4] = float("inf")  # an overflow that wins the argmax
    raw[4, 2] = float("nan")  # a NaN the chosen token does not have
    tokens = torch.tensor([0, 7, 2, 4, 9])
    for one_transfer in (None, False, True):  # the CPU's way, and the one a GPU takes
        got, bad = tokens_and_nonfinite(raw, tokens, one_transfer)
        assert got == [0, 7, 2, 4, 9]
        assert bad == [1, 3]


def _llm(path) -> LLM:
    return LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.05,
               enable_prefix_caching=False)  # fmt: skip


def test_a_request_gone_nan_errors_and_its_batch_mates_are_unharmed(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "m", vocab_size=256)
    healthy = [11, 12, 13, 14, 15, 16]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, min_tokens=8, logprobs=1)
    llm = _llm(path)
    alone = [llm.generate([{"prompt_token_ids": healthy}], sp, use_tqdm=False)[0].outputs[0]
             for sp in (greedy, sampled)]  # fmt: skip
    seen = set(healthy) | set(alone[0].token_ids) | set(alone[1].token_ids)
    poison = next(t for t in range(3, 256) if t not in seen)
    del llm
    # One embedding row of NaN: a prompt holding that token goes NaN through every layer.
    weights = load_file(str(path / "model.safetensors"))
    weights["model.embed_tokens.weight"][poison] = float("nan")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    llm = _llm(path)
    kv = llm.engine.kv
    for sp, want in zip((greedy, sampled), alone, strict=True):
        outs = llm.generate([{"prompt_token_ids": [21, poison, 22]},
                             {"prompt_token_ids": healthy}], sp, use_tqdm=False)  # fmt: skip
        bad, good = outs[0].outputs[0], outs[1].outputs[0]
        assert bad.finish_reason == "error" and list(bad.token_ids) == [] and bad.text == ""
        assert list(good.token_ids) == list(want.token_ids)
        assert good.finish_reason == "length"
        if want.logprobs is not None:
            assert all(math.isfinite(lp.logprob) for lp in good.logprobs)
        assert kv.num_free_blocks == kv.num_blocks  # the failed request's blocks too
