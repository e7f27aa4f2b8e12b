"""A request whose logits stop being finite ends with an error; the others of its steps
run on unharmed."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.engine.sample.sampler import (
    Sampler,
    SamplingRow,
    make_generator,
    tokens_and_nonfinite,
)
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


def test_drawn_rows_count_when_their_draw_probability_is_not_finite() -> None:
    raw = torch.randn(4, 11)
    tokens = torch.tensor([1, 2, 3, 4])
    rows = torch.tensor([0, 2, 3])  # rows 0, 2 and 3 were drawn; row 1 took its argmax
    p = torch.tensor([0.3, float("nan"), 0.0])
    for one_transfer in (None, False, True):
        got, bad = tokens_and_nonfinite(raw, tokens, one_transfer, drawn=(rows, p))
        assert got == [1, 2, 3, 4] and bad == [2, 3]


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1},
                                   {"logprobs": 1}, {"presence_penalty": 0.5}])  # fmt: skip
@pytest.mark.parametrize("broken", [float("nan"), float("inf")])
def test_one_broken_logit_fails_a_sampled_row_and_no_other(extra, broken) -> None:
    """One NaN or infinite logit makes a row's whole sampling distribution NaN: the draw
    then lands on some token whose own logit is finite, and the row must still count."""
    sampler = Sampler(50)

    def rows():
        out = []
        for i, sp in enumerate((SamplingParams(temperature=0.8, seed=1, **extra),
                                SamplingParams(temperature=1.0, seed=9),
                                SamplingParams(temperature=0.0))):  # fmt: skip
            out.append(SamplingRow(sp, [1, 2], [3] * i, make_generator(sp)))
        return out

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    healthy = sampler(logits.clone(), rows())
    logits[0, 7] = broken
    got = sampler(logits, rows())
    assert got.nonfinite == [0]
    assert got.token_ids[1:] == healthy.token_ids[1:] and healthy.nonfinite == []


def test_a_broken_output_row_fails_greedy_and_sampled_requests(tmp_path) -> None:
    """A NaN row of ``lm_head`` (bad weights) puts one NaN logit in every request's row:
    greedy and sampled requests end with an error instead of emitting a token as if
    nothing happened."""
    path = write_tiny_model(tmp_path / "m", vocab_size=256)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"][100] = float("nan")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    llm = _llm(path)
    for sp in (SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
               SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
               SamplingParams(temperature=0.7, top_p=0.9, max_tokens=6, ignore_eos=True)):
        out = llm.generate([{"prompt_token_ids": [11, 12, 13]}], sp, use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "error" and list(out.outputs[0].token_ids) == []
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


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


def test_a_failed_requests_blocks_leave_the_prefix_cache(tmp_path) -> None:
    """Its KV is not trusted: a later request with its prompt must compute it again."""
    path = write_tiny_model(tmp_path / "m", vocab_size=256)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.embed_tokens.weight"][200] = float("nan")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.05, block_size=16,
              enable_prefix_caching=True)  # fmt: skip
    kv = llm.engine.kv
    healthy, bad = list(range(20, 60)), [21, 200, *range(60, 98)]  # 2 full blocks each
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    outs = llm.generate([{"prompt_token_ids": bad}, {"prompt_token_ids": healthy}], sp,
                        use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "length"]
    assert kv.num_free_blocks == kv.num_blocks
    assert len(kv.pool.cached) == 2  # the healthy prompt's blocks, none of the failed one's
    out = llm.generate([{"prompt_token_ids": bad}], sp, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and out.num_cached_tokens == 0
    assert llm.generate([{"prompt_token_ids": healthy}], sp, use_tqdm=False)[0] \
        .num_cached_tokens == 32


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 8}  # fmt: skip


def test_a_request_gone_nan_while_verifying_drafts_errors(tiny_model_factory) -> None:
    """Speculative decoding checks the logits of the tokens it keeps: a request whose
    verification rows go NaN ends with an error; its batch mate's tokens are those it
    produces alone."""
    path = str(tiny_model_factory("llama"))
    llm = LLM(model=path, dtype="float32", speculative_config=SPEC, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": [9, 10, 11] * 8}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    runner = llm.engine.worker.runner
    verify = runner._verify
    poisoned: list[str] = []

    def verify_one_poisoned(logits, step):
        start = 0
        for rid, drafts in zip(step.sampling_ids, step.drafts, strict=True):
            if not poisoned and drafts and len(step.sampling_ids) == 2:
                logits[start:start + len(drafts) + 1] = float("nan")  # this request's rows
                poisoned.append(rid)
            start += len(drafts) + 1
        return verify(logits, step)

    runner._verify = verify_one_poisoned
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(poisoned) == 1  # a two-request verification step happened
    finish = [o.finish_reason for o in outs]
    assert sorted(finish) == ["error", "length"]
    bad, good = (0, 1) if finish[0] == "error" else (1, 0)
    assert list(outs[good].token_ids) == list(want[good].token_ids)
    # The failed request keeps the tokens it had before that step, and no token of it.
    assert list(outs[bad].token_ids) == list(want[bad].token_ids)[: len(outs[bad].token_ids)]
    assert len(outs[bad].token_ids) < len(want[bad].token_ids)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
