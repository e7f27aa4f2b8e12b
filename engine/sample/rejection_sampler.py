"""Verifying draft tokens: which of a request's drafts it keeps, and the token after them.

A request that verifies ``k`` drafts ``d_0 .. d_{k-1}`` has ``k + 1`` logit rows: row
``j`` is the model's distribution after its tokens and ``d_0 .. d_{j-1}``, processed
(bias, penalties, ``min_tokens``) as if those drafts were already output, since they
are exactly then.

- Greedy rows keep the drafts while each equals its row's argmax; the first row that
  disagrees gives the next token, or, all drafts kept, the last row does. The tokens are
  those of decoding without speculation.
- Sampled rows use rejection sampling against the draft's own distribution, which for
  prompt lookup is a point mass on ``d_j``: ``d_j`` is kept with probability
  ``p_j(d_j)``; on the first rejection the next token is drawn from ``p_j`` without
  ``d_j`` (the normalized residual ``max(p_j - q_j, 0)``); all kept, one more is drawn
  from ``p_k``. Each output token is then distributed exactly as ``p`` would sample it.

Seeded requests draw every random number from their own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.core.outputs import TokenLogprobs
from pagedserve.engine.sample import penalties
from pagedserve.engine.sample.sampler import (
    SamplingRow,
    is_greedy,
    logprobs_of,
    plan_draw,
    race,
    sampling_probs,
    tokens_and_nonfinite,
)
from pagedserve.engine.step_buffers import Pack, StagingBuffer


@dataclass(slots=True)
class Span:
    """One request's rows: ``rows[start : start + len(drafts) + 1]``."""

    start: int
    drafts: list[int]


def verify(logits: torch.Tensor, rows: list[SamplingRow], spans: list[Span],
           vocab_size: int, staging: StagingBuffer,
           ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None], list[int]]:  # fmt: skip
    """Per span, the tokens the request outputs this step (kept drafts, then one more)
    and, where it asked for them, their logprobs (of the raw model distribution); and the
    spans whose output tokens came from logits that were not finite (the model's numbers
    broke down for that request: its tokens are meaningless). ``staging`` is on the
    logits' device."""
    vocab = min(vocab_size, logits.shape[1])
    raw = logits[:, :vocab]
    x = raw.float().clone()
    pack = Pack()
    pen = penalties.plan(rows, vocab, pack)
    draw = plan_draw(rows, vocab, pack)
    v = staging.stage(pack.arrays)
    penalties.apply(x, pen, v)
    sampled_rows = [] if draw is None else draw.sampled
    targets = x.argmax(dim=-1).tolist() if len(sampled_rows) < len(rows) else []
    probs = None if draw is None else sampling_probs(x, draw, v)
    probs_at = {row: j for j, row in enumerate(sampled_rows)}
    tokens: list[list[int]] = []
    for span in spans:
        row = rows[span.start]
        if is_greedy(row.params):
            tokens.append(_accept_greedy(span, targets))
        else:
            tokens.append(_accept_sampled(span, probs, probs_at, row.generator))
    bad = _nonfinite_spans(raw, spans, tokens, staging, probs, probs_at)
    return tokens, _logprobs(raw, rows, spans, tokens, staging), bad


def _nonfinite_spans(raw: torch.Tensor, spans: list[Span], tokens: list[list[int]],
                     staging: StagingBuffer, probs: torch.Tensor | None,
                     probs_at: dict[int, int]) -> list[int]:  # fmt: skip
    """The spans whose output tokens' raw logits (row ``j`` of a span scores its ``j``-th
    token) are not all finite, or, for a sampled span, whose distributions gave one of them
    a probability that is NaN or not positive (a distribution with one NaN logit is NaN
    everywhere). A rejected draft's row is not read: its NaN harms nothing."""
    owner = [s for s, out in enumerate(tokens) for _ in out]
    sel = [span.start + j for span, out in zip(spans, tokens, strict=True)
           for j in range(len(out))]  # fmt: skip
    flat = [t for out in tokens for t in out]
    drawn = [i for i, row in enumerate(sel) if row in probs_at]
    arrays = [(sel, torch.int64), (flat, torch.int64)]
    if drawn:
        arrays += [(drawn, torch.int64), ([probs_at[sel[i]] for i in drawn], torch.int64),
                   ([flat[i] for i in drawn], torch.int64)]  # fmt: skip
    idx, tok, *at = staging.stage(arrays)
    p = None if not drawn else (at[0], probs[at[1], at[2]])
    _, bad_rows = tokens_and_nonfinite(raw.index_select(0, idx), tok, drawn=p)
    return sorted({owner[i] for i in bad_rows})


def _accept_greedy(span: Span, targets: list[int]) -> list[int]:
    out = []
    for j, d in enumerate(span.drafts):
        t = targets[span.start + j]
        out.append(t)
        if t != d:
            return out
    out.append(targets[span.start + len(span.drafts)])
    return out


def _accept_sampled(span: Span, probs: torch.Tensor, probs_at: dict[int, int],
                    gen: torch.Generator | None) -> list[int]:
    out = []
    for j, d in enumerate(span.drafts):
        p = probs[probs_at[span.start + j]]
        u = torch.rand(1, generator=gen, device=p.device if gen is None else gen.device)
        if u.item() < p[d].item():
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        # race() draws from residual / sum(residual): argmax is scale-free.
        out.append(int(race(residual.unsqueeze(0), [gen])[0]))
        return out
    last = probs[probs_at[span.start + len(span.drafts)]]
    out.append(int(race(last.unsqueeze(0), [gen])[0]))
    return out


def _logprobs(raw: torch.Tensor, rows: list[SamplingRow], spans: list[Span],
              tokens: list[list[int]], staging: StagingBuffer,
              ) -> list[list[TokenLogprobs] | None]:  # fmt: skip
    """Per span that asks for logprobs, those of its output tokens (row ``j`` of the
    span scores its ``j``-th token); one staging for the whole step."""
    sel: list[int] = []
    flat: list[int] = []
    for span, out in zip(spans, tokens, strict=True):
        if rows[span.start].params.logprobs is not None:
            sel.extend(range(span.start, span.start + len(out)))
            flat.extend(out)
    if not sel:
        return [None] * len(spans)
    idx, tok = staging.stage([(sel, torch.int64), (flat, torch.int64)])
    got = iter(logprobs_of(raw.index_select(0, idx), [rows[i] for i in sel], flat, tok))
    result: list[list[TokenLogprobs] | None] = []
    for span, out in zip(spans, tokens, strict=True):
        asks = rows[span.start].params.logprobs is not None
        result.append([next(got) for _ in out] if asks else None)
    return result
