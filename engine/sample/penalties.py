"""Logit processors that run before temperature: bias, min_tokens, repetition and
presence/frequency penalties, batched over the rows that need each of them.

A step's processing is planned on the host (:func:`plan`): every index and parameter
array it needs goes into the step's :class:`~pagedserve.engine.step_buffers.Pack`, which the
sampler stages with the rest of its arrays in one host-to-device copy; :func:`apply`
then runs on the device from those views alone.

The token counts the penalties read come from :class:`TokenCounts` when the rows carry
request keys: one device row of output-token counts and one of prompt-token presence
per request, each step adding only the tokens output since the last. Rows without a
key (verification rows with drafts, the memory profile) count their tokens afresh.

``logits`` is [n, V] float32 and is modified in place; rows are ``SamplingRow``-like
objects (``params``, ``prompt_token_ids``, ``output_token_ids``, ``eos_token_ids``,
``key``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.step_buffers import Pack, RowPool, StagingBuffer

i64, f32 = torch.int64, torch.float32
_NONE = np.zeros(0, dtype=np.int64)


class RowLike(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: Sequence[int]
    key: str | None


def min_tokens_banned(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """Token ids masked while fewer than ``min_tokens`` tokens have been generated.

    That is every token that would end the request: ``stop_token_ids`` and, unless
    ``ignore_eos`` (where EOS ends nothing and is an ordinary token), the EOS ids.
    """
    banned = list(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned.extend(eos_token_ids)
    return banned


def bad_word_sequences(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Each of ``words`` as token ids, as the tokenizer spells it alone and after a space
    (where that differs), without special tokens."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs[ids] = None
    return [list(s) for s in seqs]


def bad_word_bans(seqs: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Tokens a row may not sample next: the last token of each sequence whose other
    tokens end the output."""
    out = []
    for seq in seqs:
        k = len(seq) - 1
        if k == 0 or (len(output) >= k and list(output[len(output) - k:]) == list(seq[:k])):
            out.append(seq[-1])
    return out


def _flat(ids: Sequence[int], base: int, vocab: int) -> np.ndarray:
    """``base + id`` for the ids inside the vocabulary."""
    a = np.asarray(ids, dtype=np.int64)
    return base + a[(a >= 0) & (a < vocab)]


class TokenCounts:
    """Per request, on the device: how often each token was output (int32 ``[V]``) and
    which tokens its prompt holds (bool ``[V]``), brought up to date each step with the
    tokens output since the last; rows are freed when the request finishes."""

    def __init__(self, vocab: int, device: torch.device | str, num_rows: int = 8) -> None:
        self.vocab = vocab
        self.device = torch.device(device)
        self.counts = torch.zeros(num_rows, vocab, dtype=torch.int32, device=self.device)
        self.prompt_seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=self.device)
        self.rows = RowPool(num_rows)
        """Each request's row, and how many of its output tokens are counted."""

    def _grow(self, num_rows: int) -> None:
        """Reallocate with ``num_rows`` rows, keeping the rows in use."""
        n = self.num_rows
        counts = torch.zeros(num_rows, self.vocab, dtype=torch.int32, device=self.device)
        seen = torch.zeros(num_rows, self.vocab, dtype=torch.bool, device=self.device)
        counts[:n], seen[:n] = self.counts, self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        self.rows.grow(num_rows)

    @property
    def num_rows(self) -> int:
        return self.counts.shape[0]

    def release(self, key: str) -> None:
        self.rows.release(key)

    def plan(self, rows: Sequence[RowLike], pack: Pack) -> _CountsPlan:
        """The device rows of ``rows`` and, in ``pack``, the updates that bring them up
        to date: rows taken this step are cleared and get their prompt, every row gets
        its new output tokens."""
        pool = self.rows
        new = len({r.key for r in rows} - pool.row_of.keys())
        if new > pool.num_free:
            self._grow(max(self.num_rows + new - pool.num_free, 2 * self.num_rows))
        V = self.vocab
        slots, fresh, prompt_idx, out_idx = [], [], [], []
        for r in rows:
            key = r.key
            out = r.output_token_ids
            row = pool.row_of.get(key)
            if row is None or len(out) < pool.synced[key]:  # new (or a reused key)
                if row is None:
                    row = pool.take(key)
                fresh.append(row)
                prompt_idx.append(_flat(r.prompt_token_ids, row * V, V))
                pool.synced[key] = 0
            out_idx.append(_flat(out[pool.synced[key]:], row * V, V))
            pool.synced[key] = len(out)
            slots.append(row)
        return _CountsPlan(self, pack.add(slots, i64), pack.add(fresh, i64),
                           pack.add(np.concatenate(prompt_idx or [_NONE]), i64),
                           pack.add(np.concatenate(out_idx), i64))  # fmt: skip


@dataclass(slots=True)
class _CountsPlan:
    """Handles into the step's pack: rows, rows to clear, prompt and output updates."""

    counts: TokenCounts
    slots: int
    fresh: int
    prompt_idx: int
    out_idx: int

    def tensors(self, v: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Output counts and prompt presence ``[len(rows), V]`` after the updates."""
        tc = self.counts
        fresh = v[self.fresh]
        if fresh.numel():
            tc.counts.index_fill_(0, fresh, 0)
            tc.prompt_seen.index_fill_(0, fresh, False)
        tc.prompt_seen.view(-1).index_fill_(0, v[self.prompt_idx], True)
        out_idx = v[self.out_idx]
        if out_idx.numel():
            ones = torch.ones(out_idx.shape, dtype=torch.int32, device=out_idx.device)
            tc.counts.view(-1).index_add_(0, out_idx, ones)
        slots = v[self.slots]
        return tc.counts.index_select(0, slots), tc.prompt_seen.index_select(0, slots)


@dataclass(slots=True)
class _FreshPlan:
    """Counts built this step from each row's tokens (rows without a key)."""

    n: int
    vocab: int
    prompt_idx: int
    out_idx: int

    def tensors(self, v: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.n * self.vocab
        counts = torch.bincount(v[self.out_idx], minlength=size).view(self.n, self.vocab)
        seen = torch.bincount(v[self.prompt_idx], minlength=size).view(self.n, self.vocab) > 0
        return counts, seen


@dataclass(slots=True)
class PenaltyPlan:
    """Handles into the step's pack for every processor the rows need (None: off)."""

    bias: tuple[int, int, int] | None
    banned: tuple[int, int] | None
    allowed: tuple[int, int, int, int] | None
    """Rows with ``allowed_token_ids``: their indices, and (position among them, token)
    pairs of what they may sample."""
    counted: _CountsPlan | _FreshPlan | None
    """Counts of the rows in ``counted_rows``."""
    rep: tuple[int, int] | None
    """Positions among the counted rows, penalties."""
    presfreq: tuple[int, int, int] | None
    """Positions among the counted rows, frequency and presence penalties."""
    counted_rows: int
    """Handle of the counted rows' indices in the batch."""


def plan(rows: Sequence[RowLike], vocab: int, pack: Pack,
         counts: TokenCounts | None = None) -> PenaltyPlan:  # fmt: skip
    """The processing ``rows`` need, its arrays added to ``pack``. ``counts`` keeps the
    token counts of keyed rows between steps (rows without a key are counted afresh)."""
    bias_r: list[np.ndarray] = []
    bias_t: list[np.ndarray] = []
    bias_v: list[np.ndarray] = []
    ban_r: list[int] = []
    ban_t: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            t = np.fromiter(p.logit_bias, dtype=np.int64, count=len(p.logit_bias))
            keep = (t >= 0) & (t < vocab)
            bias_t.append(t[keep])
            bias_r.append(np.full(int(keep.sum()), i, dtype=np.int64))
            bias_v.append(np.fromiter(p.logit_bias.values(), dtype=np.float32,
                                      count=len(t))[keep])  # fmt: skip
        bans = bad_word_bans(p.bad_words_token_ids, r.output_token_ids) \
            if p.bad_words_token_ids else []
        if len(r.output_token_ids) < p.min_tokens:
            bans += min_tokens_banned(p, r.eos_token_ids)
        for tid in bans:
            if 0 <= tid < vocab:
                ban_r.append(i)
                ban_t.append(tid)
    bias = None
    if bias_r:
        bias = (pack.add(np.concatenate(bias_r), i64), pack.add(np.concatenate(bias_t), i64),
                pack.add(np.concatenate(bias_v), f32))  # fmt: skip
    banned = (pack.add(ban_r, i64), pack.add(ban_t, i64)) if ban_r else None
    allowed = _allowed(rows, vocab, pack)

    rep_sel = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    pf_sel = [i for i, r in enumerate(rows)
              if (r.params.presence_penalty or r.params.frequency_penalty)
              and r.output_token_ids]  # fmt: skip
    sel = sorted(set(rep_sel) | set(pf_sel))
    if not sel:
        return PenaltyPlan(bias, banned, allowed, None, None, None, -1)
    pos = {row: j for j, row in enumerate(sel)}
    sub = [rows[i] for i in sel]
    if counts is not None and all(r.key is not None for r in sub):
        counted: _CountsPlan | _FreshPlan = counts.plan(sub, pack)
    else:
        counted = _FreshPlan(len(sub), vocab, *_fresh_indices(sub, vocab, pack))
    rep = None
    if rep_sel:
        rep = (pack.add([pos[i] for i in rep_sel], i64),
               pack.add([rows[i].params.repetition_penalty for i in rep_sel], f32))
    presfreq = None
    if pf_sel:
        presfreq = (pack.add([pos[i] for i in pf_sel], i64),
                    pack.add([rows[i].params.frequency_penalty for i in pf_sel], f32),
                    pack.add([rows[i].params.presence_penalty for i in pf_sel], f32))
    return PenaltyPlan(bias, banned, allowed, counted, rep, presfreq, pack.add(sel, i64))


def _allowed(rows: Sequence[RowLike], vocab: int, pack: Pack
             ) -> tuple[int, int, int, int] | None:  # fmt: skip
    sel = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
    if not sel:
        return None
    at, tok = [], []
    for j, i in enumerate(sel):
        ids = [t for t in rows[i].params.allowed_token_ids if 0 <= t < vocab]
        at += [j] * len(ids)
        tok += ids
    return pack.add(sel, i64), pack.add(at, i64), pack.add(tok, i64), len(sel)


def _fresh_indices(rows: Sequence[RowLike], vocab: int, pack: Pack) -> tuple[int, int]:
    prompt = [_flat(r.prompt_token_ids, j * vocab, vocab) for j, r in enumerate(rows)]
    out = [_flat(r.output_token_ids, j * vocab, vocab) for j, r in enumerate(rows)]
    return pack.add(np.concatenate(prompt), i64), pack.add(np.concatenate(out), i64)


def apply(logits: torch.Tensor, pl: PenaltyPlan, v: list[torch.Tensor]) -> None:
    """Apply, in this order: logit_bias, min_tokens masking, repetition penalty (HF
    semantics over prompt and output tokens), presence/frequency penalties (OpenAI
    semantics over output tokens); ``v`` are the staged views of the plan's pack."""
    if pl.bias is not None:
        r, t, val = (v[h] for h in pl.bias)
        logits.index_put_((r, t), val, accumulate=True)
    if pl.banned is not None:
        r, t = (v[h] for h in pl.banned)
        logits.index_put_((r, t), torch.full((), float("-inf"), device=logits.device))
    if pl.allowed is not None:
        rows_h, at_h, tok_h, n = pl.allowed
        mask = torch.full((n, logits.shape[1]), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        mask.index_put_((v[at_h], v[tok_h]), torch.zeros((), dtype=logits.dtype,
                                                          device=logits.device))
        logits.index_add_(0, v[rows_h], mask)
    if pl.counted is None:
        return
    counts, prompt_seen = pl.counted.tensors(v)
    sel = v[pl.counted_rows]
    if pl.rep is not None:
        at, pen = (v[h] for h in pl.rep)
        idx = sel.index_select(0, at)
        sub = logits.index_select(0, idx)
        seen = prompt_seen.index_select(0, at) | (counts.index_select(0, at) > 0)
        pen = pen.unsqueeze(1)
        penalised = torch.where(sub > 0, sub / pen, sub * pen)
        logits.index_copy_(0, idx, torch.where(seen, penalised, sub))
    if pl.presfreq is not None:
        at, freq, pres = (v[h] for h in pl.presfreq)
        c = counts.index_select(0, at).to(logits.dtype)
        idx = sel.index_select(0, at)
        logits.index_add_(0, idx, -(freq.unsqueeze(1) * c + pres.unsqueeze(1) * (c > 0)))


def apply_all(logits: torch.Tensor, rows: Sequence[RowLike], staging: StagingBuffer,
              counts: TokenCounts | None = None) -> None:  # fmt: skip
    """Plan, stage and apply in one call (verification rows, tests)."""
    pack = Pack()
    pl = plan(rows, logits.shape[1], pack, counts)
    apply(logits, pl, staging.stage(pack.arrays))
