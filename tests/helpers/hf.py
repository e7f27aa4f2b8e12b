"""HF transformers references for the equivalence tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def hf_greedy(path: str | Path, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``generate(do_sample=False)`` of each prompt alone, exactly ``new_tokens`` tokens
    (EOS masked until then, as ``min_tokens`` does)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               do_sample=False, min_new_tokens=new_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs
