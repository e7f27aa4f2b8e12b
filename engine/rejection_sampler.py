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

from engine import penalties
from engine.outputs import TokenLogprobs
from engine.sampler import SamplingRow, is_greedy, logprobs_of, race, sampling_probs


@dataclass(slots=True)
class Span:
    """One request's rows: ``rows[start : start + len(drafts) + 1]``."""

    start: int
    drafts: list[int]


def verify(logits: torch.Tensor, rows: list[SamplingRow], spans: list[Span],
           vocab_size: int) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """Per span, the tokens the request outputs this step (kept drafts, then one more)
    and, where it asked for them, their logprobs (of the raw model distribution)."""
    raw = logits[:, :min(vocab_size, logits.shape[1])]
    x = raw.float().clone()
    penalties.apply_all(x, rows)
    sampled_rows = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
    targets = x.argmax(dim=-1).tolist() if len(sampled_rows) < len(rows) else []
    probs_at: dict[int, int] = {}
    probs = None
    if sampled_rows:
        idx = torch.tensor(sampled_rows, device=x.device)
        probs = sampling_probs(x.index_select(0, idx), [rows[i] for i in sampled_rows])
        probs_at = {row: j for j, row in enumerate(sampled_rows)}
    tokens: list[list[int]] = []
    lps: list[list[TokenLogprobs] | None] = []
    for span in spans:
        row = rows[span.start]
        if is_greedy(row.params):
            out = _accept_greedy(span, targets)
        else:
            out = _accept_sampled(span, probs, probs_at, row.generator)
        tokens.append(out)
        lps.append(_span_logprobs(raw, rows, span, out))
    return tokens, lps


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


def _span_logprobs(raw: torch.Tensor, rows: list[SamplingRow], span: Span,
                   out: list[int]) -> list[TokenLogprobs] | None:
    if rows[span.start].params.logprobs is None:
        return None
    sel = list(range(span.start, span.start + len(out)))
    idx = torch.tensor(sel, device=raw.device)
    got = logprobs_of(raw.index_select(0, idx), [rows[i] for i in sel], out)
    return [lp for lp in got if lp is not None]
