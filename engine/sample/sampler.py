"""Batched token sampling: one row of the step's logits per request that samples this step.

Pipeline per row: logit_bias -> min_tokens masking -> repetition penalty ->
presence/frequency penalties (``pagedserve.engine.sample.penalties``) -> the grammar's token bitmask (rows
with structured outputs, ``pagedserve.engine.structured``) -> temperature; greedy rows take the
argmax of the processed logits, sampled rows apply top_k, top_p, min_p and then sample.

Every index and parameter array a step needs (rows, temperatures, top-k/p, min-p,
penalties, logit bias, banned tokens) is planned on the host and staged in one
host-to-device copy (``pagedserve.engine.step_buffers``); nothing builds a device tensor from a
Python list per step.

Randomness: a seeded row draws only from its own generator, always a ``[vocab_size]``
exponential tensor, so its tokens do not depend on the rest of the batch. Unseeded rows
share one batched draw from torch's global generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.engine.core.outputs import Logprob, TokenLogprobs
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.sample import penalties
from pagedserve.engine.step_buffers import Pack, StagingBuffer
from pagedserve.engine.structured import bitmask
from pagedserve.engine.structured.backend import Matcher

_GREEDY_EPS = 1e-5
i64, f32 = torch.int64, torch.float32


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
    key: str | None = None
    """The request's id: the sampler keeps its penalty token counts on the device from
    step to step (None: counted afresh from the token lists)."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """Per row: raw-distribution logprobs when ``params.logprobs`` is set, else None."""
    nonfinite: list[int] = field(default_factory=list)
    """Rows whose chosen token's raw logit is NaN or infinite: the model's numbers broke
    down for that request (its token is meaningless)."""


def tokens_and_nonfinite(raw: torch.Tensor, tokens: torch.Tensor,
                         one_transfer: bool | None = None,
                         drawn: tuple[torch.Tensor, torch.Tensor] | None = None,
                         ) -> tuple[list[int], list[int]]:  # fmt: skip
    """The chosen ``tokens`` as a list, and the rows whose chosen raw logit is not finite
    (an all-NaN row has no meaningful argmax): off the CPU (``one_transfer`` None), both in
    one transfer from the device.

    ``drawn``: the rows whose token was drawn from a distribution, and the probability of
    the token each drew. Such a row also counts when that probability is NaN or not
    positive: one NaN or infinite logit makes the whole distribution NaN, and the draw
    then picks a token whose own logit may well be finite."""
    n = tokens.shape[0]
    chosen = raw.gather(1, tokens.view(-1, 1).long()).view(-1)
    if one_transfer is None:
        one_transfer = raw.device.type != "cpu"
    if not one_transfer and drawn is None:  # no transfer to save: the fewest torch calls
        vals = chosen.tolist()
        return tokens.tolist(), [i for i, v in enumerate(vals) if not math.isfinite(v)]
    fine = torch.isfinite(chosen)
    if drawn is not None:
        rows, p = drawn
        fine[rows] &= torch.isfinite(p) & (p > 0)
    if not one_transfer:
        return tokens.tolist(), [i for i, ok in enumerate(fine.tolist()) if not ok]
    both = torch.cat([tokens.view(-1).long(), fine.long()]).tolist()
    return both[:n], [i for i in range(n) if not both[n + i]]


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
        and not p.allowed_token_ids
        and not p.bad_words_token_ids
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
        self.staging: StagingBuffer | None = None
        """The step's sampling arrays, staged in one copy (made on the logits' device)."""
        self.counts: penalties.TokenCounts | None = None
        """Penalty token counts of the keyed rows, on the device."""

    def release(self, key: str) -> None:
        """Forget a finished request's token counts."""
        if self.counts is not None:
            self.counts.release(key)

    def staging_on(self, dev: torch.device) -> StagingBuffer:
        """The sampler's staging buffer (made, with the token counts, on first use)."""
        if self.staging is None or self.staging.device != dev:
            self.staging = StagingBuffer(dev)
            self.counts = penalties.TokenCounts(self.vocab_size, dev)
        return self.staging

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits`` is [len(rows), V] with V >= vocab_size (padded columns are ignored)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        vocab = min(self.vocab_size, logits.shape[1])
        raw = logits[:, :vocab]
        special = [i for i, r in enumerate(rows) if not _is_plain_greedy(r)]
        if not special:
            token_list, bad = tokens_and_nonfinite(raw, self._argmax(raw))
            return SamplerOutput(token_list, [None] * len(rows), bad)

        dev = logits.device
        staging = self.staging_on(dev)
        sub_rows = [rows[i] for i in special]
        every = len(special) == len(rows)
        pack = Pack()
        h_special = None if every else pack.add(special, i64)
        pen = penalties.plan(sub_rows, vocab, pack, self.counts)
        draw = plan_draw(sub_rows, vocab, pack)
        constrained = [j for j, r in enumerate(sub_rows) if r.matcher is not None]
        h_constrained = (pack.add(constrained, i64)
                         if 0 < len(constrained) < len(sub_rows) else None)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        h_want = pack.add(want, i64) if want and len(want) < len(rows) else None
        v = staging.stage(pack.arrays)

        special_t = None if every else v[h_special]
        x = _processing_copy(raw, special_t)
        penalties.apply(x, pen, v)
        if constrained:
            mask = self._bitmask.fill([sub_rows[j].matcher for j in constrained], x.shape[1],
                                      pin_memory=dev.type == "cuda")
            bitmask.apply(x, None if h_constrained is None else constrained, mask,
                          None if h_constrained is None else v[h_constrained])
        picked = self._argmax(x)
        drawn = None
        if draw is not None:
            probs = sampling_probs(x, draw, v)
            got = race(probs, draw.gens, draw.unseeded_view(v))
            picked.index_copy_(0, v[draw.rows], got)
            drawn = (v[draw.rows] if every else special_t[v[draw.rows]],
                     probs.gather(1, got.view(-1, 1)).view(-1))  # fmt: skip
        if every:  # no argmax of the raw rows
            tokens = picked
        else:
            tokens = self._argmax(raw)
            tokens.index_copy_(0, special_t, picked)
        token_list, bad = tokens_and_nonfinite(raw, tokens, drawn=drawn)
        lps = [None] * len(rows)
        if want:
            lps = logprobs_of(raw, rows, token_list, tokens,
                              None if h_want is None else v[h_want])
        return SamplerOutput(token_list, lps, bad)


def _processing_copy(raw: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """A contiguous float32 copy of ``raw`` (of its ``rows``; None: all of them), safe to
    process in place. A float32 CPU copy is made by numpy in this thread: split across
    torch's intra-op threads, a few rows cost more in waiting than in copying."""
    if raw.device.type == "cpu" and raw.dtype == torch.float32:
        a = raw.numpy()
        return torch.from_numpy(a.copy() if rows is None else a[rows.numpy()])
    if rows is None:
        return raw.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return raw.index_select(0, rows).float()


@dataclass(slots=True)
class DrawPlan:
    """The sampled (not greedy) rows of a batch and the handles of their parameters in
    the step's pack: what :func:`sampling_probs` and :func:`race` read."""

    sampled: list[int]
    """Positions of the sampled rows in the batch."""
    rows: int
    """Handle of ``sampled``."""
    temps: int
    top_k: tuple[int, int] | None
    """(largest k, positions k-1 per row) when any row keeps fewer than V tokens."""
    top_p: int | None
    min_p: int | None
    unseeded: int | None
    """Positions (among the sampled rows) of those without a generator, when some have one."""
    gens: list[torch.Generator | None]

    def unseeded_view(self, v: list[torch.Tensor]) -> torch.Tensor | None:
        return None if self.unseeded is None else v[self.unseeded]


def plan_draw(rows: list[SamplingRow], vocab: int, pack: Pack) -> DrawPlan | None:
    """The draw of the rows that sample (None when every row is greedy)."""
    sampled = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
    if not sampled:
        return None
    params = [rows[i].params for i in sampled]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_k = None
    if any(k < vocab for k in ks):
        top_k = (max(ks), pack.add([k - 1 for k in ks], i64))
    ps, mins = [p.top_p for p in params], [p.min_p for p in params]
    gens = [rows[i].generator for i in sampled]
    unseeded = [j for j, g in enumerate(gens) if g is None]
    return DrawPlan(
        sampled=sampled, rows=pack.add(sampled, i64), temps=pack.add([p.temperature for p in params], f32),
        top_k=top_k, top_p=None if all(p >= 1.0 for p in ps) else pack.add(ps, f32),
        min_p=pack.add(mins, f32) if any(mins) else None,
        unseeded=pack.add(unseeded, i64) if 0 < len(unseeded) < len(gens) else None,
        gens=gens)  # fmt: skip


def sampling_probs(x: torch.Tensor, draw: DrawPlan, v: list[torch.Tensor]) -> torch.Tensor:
    """The distribution each sampled row draws from: processed logits ``x`` (bias and
    penalties applied; every row of the batch) at the sampled rows, over temperature,
    then top_k, top_p and min_p."""
    xs = x.index_select(0, v[draw.rows]) / v[draw.temps].unsqueeze(1)
    if draw.top_k is not None:
        kmax, pos = draw.top_k
        thresh = xs.topk(kmax, dim=-1).values.gather(1, v[pos].unsqueeze(1))
        xs.masked_fill_(xs < thresh, float("-inf"))  # ties at the k-th value are kept
    if draw.top_p is not None:
        xs.masked_fill_(top_p_drop(torch.softmax(xs, dim=-1), v[draw.top_p]), float("-inf"))
    if draw.min_p is not None:
        # Drop tokens whose probability is below min_p times the most likely token's.
        probs = torch.softmax(xs, dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * v[draw.min_p].unsqueeze(1)
        xs.masked_fill_(probs < thresh, float("-inf"))
    return torch.softmax(xs, dim=-1)


TOP_P_CANDIDATES = 1024
"""The most likely tokens :func:`top_p_drop` sorts first on the CPU."""


def top_p_drop(probs: torch.Tensor, top_p: torch.Tensor,
               candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:  # fmt: skip
    """The tokens top_p drops from each row of ``probs``: all but the smallest set of most
    likely tokens whose mass reaches the row's ``top_p`` (at least one).

    On the CPU, when the ``candidates - 1`` most likely tokens of every row already hold
    its top_p, that set lies among the ``candidates`` most likely, and only those are
    sorted (``topk``) instead of the whole vocabulary: a 262,144-token vocabulary's sort
    costs milliseconds a step. The kept set is the same; tokens of equal probability at
    the cut are ordered as the sort orders them, either way."""
    p = top_p.unsqueeze(1)
    if probs.device.type == "cpu" and 0 < candidates < probs.shape[-1] // 2:
        top, where = probs.topk(candidates, dim=-1)
        drop = _drop_sorted(top, p)
        if bool(drop[:, -1].all()):  # the last candidate goes, so do the ones after it
            return torch.ones_like(probs, dtype=torch.bool).scatter_(1, where, drop)
    ordered, order = probs.sort(dim=-1, descending=True)
    drop = _drop_sorted(ordered, p)
    return torch.zeros_like(drop).scatter_(1, order, drop)


def _drop_sorted(ordered: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Of probabilities sorted most likely first, those whose more likely tokens already
    hold ``p`` of the mass (never the first)."""
    drop = ordered.cumsum(dim=-1) - ordered >= p
    drop[:, 0] = False
    return drop


def race(probs: torch.Tensor, gens: list[torch.Generator | None],
         unseeded: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Sample one token per row: argmax(probs / q) with q ~ Exp(1) is a draw from probs.

    Rows without a generator share one draw from the global generator; when some rows
    have one, ``unseeded`` indexes the others."""
    n, vocab = probs.shape
    q = torch.empty_like(probs)
    if all(g is None for g in gens):
        q.exponential_()
    else:
        if unseeded is not None:
            q.index_copy_(0, unseeded, torch.empty(unseeded.shape[0], vocab, dtype=q.dtype,
                                                   device=q.device).exponential_())
        for i, g in enumerate(gens):
            if g is not None:
                q[i] = torch.empty(vocab, dtype=q.dtype, device=g.device).exponential_(
                    generator=g)
    return (probs / q).argmax(dim=-1)


def logprobs_of(raw: torch.Tensor, rows: list[SamplingRow], tokens: list[int],
                tokens_t: torch.Tensor, want: torch.Tensor | None = None,
                ) -> list[TokenLogprobs | None]:  # fmt: skip
    """Logprobs of the raw model distribution (before bias, penalties and temperature)
    of the rows that ask for them; ``tokens_t`` holds ``tokens`` on the device and
    ``want`` the positions of those rows there (None: every row asks)."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    sel = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want is None:
        if len(sel) != len(rows):
            raise ValueError("want is needed when not every row asks for logprobs")
        lp, chosen_t = raw.float(), tokens_t
    else:
        lp, chosen_t = raw.index_select(0, want).float(), tokens_t.index_select(0, want)
    entries = token_logprobs(lp, [tokens[i] for i in sel], chosen_t,
                             [rows[i].params.logprobs or 0 for i in sel])
    for j, i in enumerate(sel):
        out[i] = entries[j]
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], tokens_t: torch.Tensor,
                   ks: list[int]) -> list[TokenLogprobs]:
    """Per row of ``logits`` (float32): the log-probability of ``tokens[j]`` (also
    ``tokens_t`` on the device), its rank, and the ``ks[j]`` most likely candidates."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, tokens_t.unsqueeze(1).to(torch.int64))
    kmax = max(ks, default=0)
    chosen_l = chosen.squeeze(1).tolist()
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    if kmax:
        top = lp.topk(kmax, dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    return [TokenLogprobs(tokens[j], chosen_l[j],
                          [Logprob(top_i[j][r], top_v[j][r], r + 1) for r in range(k)],
                          ranks[j]) for j, k in enumerate(ks)]  # fmt: skip
