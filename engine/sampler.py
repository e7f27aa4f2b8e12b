"""Batched token sampling: one row of the step's logits per request that samples this step.

Pipeline per row: logit_bias -> min_tokens masking -> repetition penalty ->
presence/frequency penalties (``engine.penalties``) -> the grammar's token bitmask (rows
with structured outputs, ``engine.structured``) -> temperature; greedy rows take the
argmax of the processed logits, sampled rows apply top_k, top_p, min_p and then sample.

Randomness: a seeded row draws only from its own generator, always a ``[vocab_size]``
exponential tensor, so its tokens do not depend on the rest of the batch. Unseeded rows
share one batched draw from torch's global generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import penalties
from engine.outputs import Logprob, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured import bitmask
from engine.structured.backend import Matcher

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingRow:
    """The sampling state of one request for one step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated so far, before this step."""
    generator: torch.Generator | None
    """Per-request generator seeded from ``params.seed``; None uses the global generator."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's EOS ids (masked, with the stop token ids, until ``min_tokens``)."""
    matcher: Matcher | None = None
    """The request's grammar matcher (structured outputs): masks the tokens it forbids."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """Per row: raw-distribution logprobs when ``params.logprobs`` is set, else None."""


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu", index: int = 0
) -> torch.Generator | None:
    """A generator seeded from ``params.seed``, or None when the request has no seed.

    ``index`` is the choice among ``n``: each sibling gets its own stream, and choice 0
    the plain seed.
    """
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((params.seed + index * 1_000_003) % 2**63)
    return g


def is_greedy(params: SamplingParams) -> bool:
    """Greedy rows take the argmax; ``top_k=1`` is greedy by definition."""
    return params.temperature < _GREEDY_EPS or params.top_k == 1


def _is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that changes the logits and no logprobs: argmax of raw logits."""
    p = row.params
    return (
        is_greedy(p)
        and row.matcher is None
        and p.logprobs is None
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and len(row.output_token_ids) >= p.min_tokens
    )


class Sampler:
    """Turns a step's logits into one token (and optional logprobs) per row."""

    def __init__(
        self, vocab_size: int, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self._argmax = argmax or (lambda x: x.argmax(dim=-1))
        """Row-wise argmax of raw and of processed logits (the kernel backend's, e.g. native
        on the CPU)."""
        self._bitmask = bitmask.TokenBitmask()
        """The grammar bitmask of the constrained rows, allocated once and refilled."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits`` is [len(rows), V] with V >= vocab_size (padded columns are ignored)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        vocab = min(self.vocab_size, logits.shape[1])
        raw = logits[:, :vocab]
        special = [i for i, r in enumerate(rows) if not _is_plain_greedy(r)]
        if not special:
            return SamplerOutput(self._argmax(raw).tolist(), [None] * len(rows))

        dev = logits.device
        sub_rows = [rows[i] for i in special]
        every = len(special) == len(rows)
        x = _processing_copy(raw, None if every else special)
        penalties.apply_all(x, sub_rows)
        constrained = [j for j, r in enumerate(sub_rows) if r.matcher is not None]
        if constrained:
            mask = self._bitmask.fill([sub_rows[j].matcher for j in constrained], x.shape[1],
                                      pin_memory=dev.type == "cuda")
            bitmask.apply(x, None if len(constrained) == len(sub_rows) else constrained, mask)
        picked = _pick(x, sub_rows, self._argmax)
        if every:  # no argmax of the raw rows
            tokens = picked
        else:
            tokens = self._argmax(raw)
            tokens[torch.tensor(special, device=dev)] = picked
        token_list = tokens.tolist()
        return SamplerOutput(token_list, logprobs_of(raw, rows, token_list))


def _processing_copy(raw: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """A contiguous float32 copy of ``raw`` (of its ``rows``; None: all of them), safe to
    process in place. A float32 CPU copy is made by numpy in this thread: split across
    torch's intra-op threads, a few rows cost more in waiting than in copying."""
    if raw.device.type == "cpu" and raw.dtype == torch.float32:
        a = raw.numpy()
        return torch.from_numpy(a.copy() if rows is None else a[rows])
    if rows is None:
        return raw.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return raw.index_select(0, torch.tensor(rows, device=raw.device)).float()


def _pick(x: torch.Tensor, rows: list[SamplingRow],
          argmax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Tokens for processed logits ``x`` (modified in place)."""
    out = argmax(x)
    sampled = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
    if not sampled:
        return out
    idx = torch.tensor(sampled, device=x.device)
    s_rows = [rows[i] for i in sampled]
    probs = sampling_probs(x.index_select(0, idx), s_rows)
    out[idx] = race(probs, [r.generator for r in s_rows])
    return out


def sampling_probs(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each sampled row draws from: processed logits ``x`` (bias and
    penalties applied) over temperature, then top_k, top_p and min_p."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype, device=x.device)
    xs = x / temps.unsqueeze(1)
    _top_k(xs, [r.params.top_k for r in rows])
    _top_p(xs, [r.params.top_p for r in rows])
    _min_p(xs, [r.params.min_p for r in rows])
    return torch.softmax(xs, dim=-1)


def _top_k(x: torch.Tensor, ks: list[int]) -> None:
    """Keep the k largest logits per row (ties at the k-th value are kept); 0 = off."""
    vocab = x.shape[1]
    if not any(0 < k < vocab for k in ks):
        return
    k_eff = [k if 0 < k < vocab else vocab for k in ks]
    kmax = max(k_eff)
    top = x.topk(kmax, dim=-1).values
    pos = torch.tensor([k - 1 for k in k_eff], device=x.device).unsqueeze(1)
    thresh = top.gather(1, pos)
    x.masked_fill_(x < thresh, float("-inf"))


def _top_p(x: torch.Tensor, ps: list[float]) -> None:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    if all(p >= 1.0 for p in ps):
        return
    p = torch.tensor(ps, dtype=x.dtype, device=x.device).unsqueeze(1)
    probs, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted = before >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    x.masked_fill_(drop, float("-inf"))


def _min_p(x: torch.Tensor, ps: list[float]) -> None:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if not any(ps):
        return
    m = torch.tensor(ps, dtype=x.dtype, device=x.device).unsqueeze(1)
    probs = torch.softmax(x, dim=-1)
    thresh = probs.max(dim=-1, keepdim=True).values * m
    x.masked_fill_(probs < thresh, float("-inf"))


def race(probs: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row: argmax(probs / q) with q ~ Exp(1) is a draw from probs."""
    n, vocab = probs.shape
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(gens) if g is None]
    if len(unseeded) == n:
        q.exponential_()
    else:
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            q[idx] = torch.empty(len(unseeded), vocab, device=probs.device).exponential_()
        for i, g in enumerate(gens):
            if g is not None:
                q[i] = torch.empty(vocab, device=g.device).exponential_(generator=g).to(q.device)
    return (probs / q).argmax(dim=-1)


def logprobs_of(
    raw: torch.Tensor, rows: list[SamplingRow], tokens: list[int]
) -> list[TokenLogprobs | None]:
    """Logprobs of the raw model distribution (before bias, penalties and temperature)."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return out
    dev = raw.device
    idx = torch.tensor(want, device=dev)
    lp = torch.log_softmax(raw.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in want], device=dev).unsqueeze(1))
    kmax = max(rows[i].params.logprobs or 0 for i in want)
    chosen_l = chosen.squeeze(1).tolist()
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    if kmax:
        top = lp.topk(kmax, dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(want):
        k = rows[i].params.logprobs or 0
        cands = [Logprob(top_i[j][r], top_v[j][r], r + 1) for r in range(k)] if k else []
        out[i] = TokenLogprobs(tokens[i], chosen_l[j], cands, ranks[j])
    return out
