"""One token bitmask per step for the constrained rows, applied to their logits."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.structured.backend import Matcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill(matchers: Sequence[Matcher], vocab_size: int) -> torch.Tensor:
    """``int32 [len(matchers), ceil(vocab / 32)]``: each matcher's allowed next tokens."""
    bm = torch.empty((len(matchers), bitmask_words(vocab_size)), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_bitmask(bm, i)
    return bm


def apply(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in ``logits[rows[i]]``, every token that row ``i`` of ``bitmask``
    does not allow (columns past the mask, padding of the vocabulary, are masked)."""
    vocab = logits.shape[1]
    n = bitmask.shape[0]
    # int32 words little-endian as bytes: byte k of word w holds tokens 32w+8k .. 32w+8k+7.
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1,
                         bitorder="little")
    allowed = torch.from_numpy(bits.view(np.bool_)).view(n, -1)
    width = allowed.shape[1]
    if width < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - width), value=False)
    allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
    idx = torch.tensor(list(rows), device=logits.device)
    sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)
