"""HF transformers references for the equivalence tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def hf_greedy(path: str | Path, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``generate(do_sample=False)`` of each prompt alone, exactly ``new_tokens`` tokens
    (EOS masked until then, as ``min_tokens`` does)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return greedy_of(model, prompt_ids, new_tokens)


def greedy_of(model, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """:func:`hf_greedy` with a model already loaded."""
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               do_sample=False, min_new_tokens=new_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


PROMPT_LOGPROB_TOL = 2e-3
"""How far a logprob may be from HF's (float32 sums in another order)."""


def hf_prompt_logprobs(path: str | Path, prompts: list[list[int]], k: int) -> list[tuple]:
    """Per prompt and position: HF's logprob of the next prompt token, the range of
    ranks it has within ``PROMPT_LOGPROB_TOL`` and the ``k + 1`` most likely tokens
    (logprobs, ids)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
            target = torch.tensor(p[1:])
            chosen = lp.gather(1, target[:, None])
            tol = PROMPT_LOGPROB_TOL
            ranks = list(zip(((lp > chosen + tol).sum(dim=-1) + 1).tolist(),
                             ((lp > chosen - tol).sum(dim=-1) + 1).tolist(), strict=True))
            top = lp.topk(k + 1, dim=-1)
            out.append((chosen[:, 0].tolist(), ranks, top.values.tolist(), top.indices.tolist()))
    return out
