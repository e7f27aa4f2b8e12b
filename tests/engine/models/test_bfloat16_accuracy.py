"""bfloat16 against float32: the default model run in bfloat16 (the CPU's default dtype
where it computes in bfloat16 natively, and CUDA's) follows HF transformers' float32 model
on the same checkpoint within a stated tolerance, on whichever CPU path the code chose
(native bfloat16 products, or bfloat16 widened to float32 and rounded back)."""

from __future__ import annotations

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import paths as cpu_paths
from tests.helpers.hf import hf_greedy, hf_scores
from tests.helpers.prompts import default_prompt_ids

NEW = 32
LOGPROB_TOL = 0.4
"""How far a bfloat16 logprob may be from float32's (bfloat16 keeps 8 significant bits,
the logits themselves among them: on 459 positions of the default model at most 0.29-0.32
on the native, the widened and the torch paths; a residual stream rounded to 7
significant bits makes it 0.59). Also the smallest margin between float32's two best
logits at which bfloat16 must pick float32's best."""
MEAN_TOL = 0.04
"""How far bfloat16 logprobs may be from float32's on average (0.029-0.032 measured on
those paths; partial sums of 64 products added in bfloat16 make it 0.050)."""


def test_bfloat16_follows_the_float32_reference(default_model_path, default_tokenizer):
    """Each token's logprob, of the prompts and of float32's greedy continuations, within
    :data:`LOGPROB_TOL` of HF float32's (and within :data:`MEAN_TOL` on average), and
    float32's best token bfloat16's best wherever float32's two best logits are that
    tolerance apart; bfloat16's own greedy tokens equal float32's up to the first
    position where they are closer (where bfloat16 may pick the other)."""
    prompts = default_prompt_ids(default_tokenizer)
    # The equivalence tests' reference (the same prompts, 64 tokens), computed once.
    ref_tokens = [t[:NEW] for t in hf_greedy(default_model_path, prompts, 64)]
    full = [p + t for p, t in zip(prompts, ref_tokens, strict=True)]
    ref = hf_scores(default_model_path, full)

    llm = LLM(dtype="bfloat16", max_num_batched_tokens=512)
    assert llm.engine.settings.dtype == torch.bfloat16
    device = llm.engine.settings.device
    path: dict[str, object] = {"device": str(device)}
    if device.type == "cpu":  # the path the code chose: native bfloat16 or widened
        info = cpu_paths.describe(llm.engine.worker.attn, torch.bfloat16)
        path.update((k, info[k]) for k in ("native_bf16", "attention", "linear_bf16", "layers"))
        assert info["layers"].startswith("per-op"), path  # the fused call is float32 only
    free = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + full],
                        [free] * len(prompts) + [forced] * len(full), use_tqdm=False)

    # float32's greedy continuation as the prompt: every position scored, prefixes equal.
    errors, best_differs = [], []
    for out, (logprobs, best, margins) in zip(outs[len(prompts):], ref, strict=True):
        entries = out.prompt_logprobs[1:]
        errors += [abs(e.logprob - want) for e, want in zip(entries, logprobs, strict=True)]
        best_differs += [(i, e.top[0].token_id, b)
                         for i, (e, b, m) in enumerate(zip(entries, best, margins, strict=True))
                         if m >= LOGPROB_TOL and e.top[0].token_id != b]  # fmt: skip
    worst, mean = max(errors), sum(errors) / len(errors)
    assert worst < LOGPROB_TOL, (worst, mean, path)
    assert mean < MEAN_TOL, (worst, mean, path)
    assert not best_differs, (best_differs, path)

    # Free-running: float32's tokens up to its first close call.
    compared = 0
    for out, p, want, (_, _, margins) in zip(outs[: len(prompts)], prompts, ref_tokens, ref,
                                             strict=True):  # fmt: skip
        end = next((i for i, m in enumerate(margins[len(p) - 1:]) if m < LOGPROB_TOL), NEW)
        got = list(out.outputs[0].token_ids)
        assert got[:end] == want[:end], (p, end, got, want, path)
        compared += end
    assert compared >= 4 * len(prompts), compared  # 55 here
