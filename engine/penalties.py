"""Logit processors that run before temperature: bias, min_tokens, repetition and
presence/frequency penalties, batched over the rows that need each of them.

Every function takes ``logits`` ([n, V] float32, modified in place) and the matching
``SamplingRow``-like objects (``params``, ``prompt_token_ids``, ``output_token_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams


class RowLike(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: Sequence[int]


def apply_all(logits: torch.Tensor, rows: Sequence[RowLike]) -> None:
    """Apply, in this order: logit_bias, min_tokens masking, repetition penalty,
    presence/frequency penalties."""
    apply_logit_bias(logits, rows)
    apply_min_tokens(logits, rows)
    apply_repetition_penalty(logits, rows)
    apply_presence_frequency(logits, rows)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[RowLike]) -> None:
    """Add ``params.logit_bias`` ({token_id: bias}); ids outside the vocabulary are ignored
    (the engine rejects them at admission: ``InputLimits.check_sampling_token_ids``).

    Each row's entries become tensors in bulk and the whole step's bias is one
    ``index_put_``: no Python work per entry."""
    r_parts: list[torch.Tensor] = []
    t_parts: list[torch.Tensor] = []
    v_parts: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if not bias:
            continue
        r_parts.append(torch.full((len(bias),), i, dtype=torch.long))
        t_parts.append(torch.tensor(list(bias), dtype=torch.long))
        v_parts.append(torch.tensor(list(bias.values()), dtype=logits.dtype))
    if not r_parts:
        return
    r_idx, t_idx, vals = torch.cat(r_parts), torch.cat(t_parts), torch.cat(v_parts)
    keep = (t_idx >= 0) & (t_idx < logits.shape[1])
    dev = logits.device
    logits.index_put_((r_idx[keep].to(dev), t_idx[keep].to(dev)), vals[keep].to(dev),
                      accumulate=True)


def min_tokens_banned(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """Token ids masked while fewer than ``min_tokens`` tokens have been generated.

    That is every token that would end the request: ``stop_token_ids`` and, unless
    ``ignore_eos`` (where EOS ends nothing and is an ordinary token), the EOS ids.
    """
    banned = list(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned.extend(eos_token_ids)
    return banned


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[RowLike]) -> None:
    """Set the logits of stopping tokens to -inf while ``len(output) < min_tokens``."""
    vocab = logits.shape[1]
    r_idx: list[int] = []
    t_idx: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        for tid in min_tokens_banned(row.params, row.eos_token_ids):
            if 0 <= tid < vocab:
                r_idx.append(i)
                t_idx.append(tid)
    if not r_idx:
        return
    dev = logits.device
    logits[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = float("-inf")


def _padded_ids(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[n, max_len] long tensor of ``seqs``, right-padded with ``pad``."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(width, 1)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device, non_blocking=True)


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[RowLike]) -> None:
    """HF semantics over prompt + output tokens: positive logits of seen tokens are
    divided by the penalty, negative ones multiplied."""
    sel = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not sel:
        return
    vocab = logits.shape[1]
    dev = logits.device
    ids = _padded_ids(
        [rows[i].prompt_token_ids + rows[i].output_token_ids for i in sel], vocab, dev
    )
    seen = torch.zeros(len(sel), vocab + 1, dtype=torch.bool, device=dev)
    seen.scatter_(1, ids.clamp_(0, vocab), True)
    seen = seen[:, :vocab]
    pen = torch.tensor(
        [rows[i].params.repetition_penalty for i in sel], dtype=logits.dtype, device=dev
    ).unsqueeze(1)
    idx = torch.tensor(sel, device=dev)
    sub = logits[idx]
    penalised = torch.where(sub > 0, sub / pen, sub * pen)
    logits[idx] = torch.where(seen, penalised, sub)


def apply_presence_frequency(logits: torch.Tensor, rows: Sequence[RowLike]) -> None:
    """OpenAI semantics over output tokens:
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``."""
    sel = [
        i
        for i, r in enumerate(rows)
        if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids
    ]
    if not sel:
        return
    vocab = logits.shape[1]
    dev = logits.device
    ids = _padded_ids([rows[i].output_token_ids for i in sel], vocab, dev).clamp_(0, vocab)
    counts = torch.zeros(len(sel), vocab + 1, dtype=logits.dtype, device=dev)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    freq = torch.tensor(
        [rows[i].params.frequency_penalty for i in sel], dtype=logits.dtype, device=dev
    ).unsqueeze(1)
    pres = torch.tensor(
        [rows[i].params.presence_penalty for i in sel], dtype=logits.dtype, device=dev
    ).unsqueeze(1)
    idx = torch.tensor(sel, device=dev)
    logits[idx] -= freq * counts + pres * (counts > 0).to(logits.dtype)
