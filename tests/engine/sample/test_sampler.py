"""Batched sampler: greedy/argmax equivalence, seeded reproducibility, filters, penalties,
logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.sample import penalties
from pagedserve.engine.sample.sampler import Sampler, SamplingRow, make_generator
from pagedserve.engine.step_buffers import StagingBuffer

V = 64


def row(prompt: list[int] | None = None, output: list[int] | None = None, **kw) -> SamplingRow:
    p = SamplingParams(**kw)
    return SamplingRow(p, list(prompt or [1, 2, 3]), list(output or []), make_generator(p))


def rand_logits(b: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_of_raw_logits() -> None:
    logits = rand_logits(8)
    out = Sampler(V)(logits, [row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_padded_vocab_columns_are_never_chosen() -> None:
    logits = rand_logits(3, V + 16)
    logits[:, V:] = 100.0  # padding columns beyond the tokenizer's vocabulary
    rows = [row(temperature=0.0), row(temperature=1.0, seed=1), row(temperature=0.0, logprobs=3)]
    out = Sampler(V)(logits, rows)
    assert all(t < V for t in out.token_ids)
    assert out.token_ids[0] == logits[0, :V].argmax().item()
    assert all(c.token_id < V for c in out.logprobs[2].top)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_equals_greedy(temperature: float) -> None:
    logits = rand_logits(16, seed=3)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: both pick the first index
    greedy = Sampler(V)(logits, [row(temperature=0.0) for _ in range(16)]).token_ids
    topk1 = Sampler(V)(
        logits, [row(temperature=temperature, top_k=1, seed=i) for i in range(16)]
    ).token_ids
    assert topk1 == greedy
    assert greedy[0] == 5


def test_greedy_with_penalty_uses_processed_logits() -> None:
    logits = torch.full((1, V), -5.0)
    logits[0, 7] = 2.0  # seen in the prompt
    logits[0, 8] = 1.5
    plain = Sampler(V)(logits, [row(prompt=[7], temperature=0.0)]).token_ids
    penalised = Sampler(V)(
        logits, [row(prompt=[7], temperature=0.0, repetition_penalty=2.0)]
    ).token_ids
    assert plain == [7]
    assert penalised == [8]


def _run_steps(rows_fn, target: int, steps: int = 20) -> list[int]:
    """Sample ``steps`` tokens for the row at index ``target`` of a batch built by rows_fn."""
    sampler = Sampler(V)
    rows = rows_fn()
    got = []
    for step in range(steps):
        logits = rand_logits(len(rows), seed=100 + step)
        # The target row always sees the same logits, whatever the batch looks like.
        logits[target] = rand_logits(1, seed=500 + step)[0] / 3
        got.append(sampler(logits, rows).token_ids[target])
    return got


def test_seeded_row_is_reproducible_regardless_of_batch() -> None:
    alone = _run_steps(lambda: [row(temperature=1.0, seed=42)], 0)
    crowded = _run_steps(
        lambda: [
            row(temperature=0.7),
            row(temperature=1.0, seed=7, top_p=0.5),
            row(temperature=0.0),
            row(temperature=1.0, seed=42),
            row(temperature=1.3, top_k=5),
        ],
        3,
    )
    assert crowded == alone
    other_seed = _run_steps(lambda: [row(temperature=1.0, seed=43)], 0)
    assert other_seed != alone
    assert len(set(alone)) > 3  # it really samples


def test_unseeded_sampling_matches_softmax_distribution() -> None:
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.0, -1.0, -1.0, 0.5, -3.0, 1.5])
    n = 20000
    out = Sampler(8)(base.repeat(n, 1), [row(temperature=1.0) for _ in range(n)]).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=8).float() / n
    expected = torch.softmax(base, -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_temperature_sharpens_and_flattens() -> None:
    torch.manual_seed(1)
    base = torch.tensor([1.0, 0.0, 0.0, 0.0])
    n = 4000
    cold = Sampler(4)(base.repeat(n, 1), [row(temperature=0.1) for _ in range(n)]).token_ids
    hot = Sampler(4)(base.repeat(n, 1), [row(temperature=10.0) for _ in range(n)]).token_ids
    assert cold.count(0) / n > 0.99
    assert 0.2 < hot.count(0) / n < 0.35


def _support(logits_row: torch.Tensor, n: int = 3000, **kw) -> set[int]:
    torch.manual_seed(2)
    out = Sampler(logits_row.numel())(
        logits_row.repeat(n, 1), [row(temperature=1.0, **kw) for _ in range(n)]
    )
    return set(out.token_ids)


def test_top_k_limits_support() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6, 2.5])
    assert _support(logits, top_k=3) == {0, 1, 2}
    assert _support(logits, top_k=0) == set(range(6))


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert _support(logits, top_p=0.5) == {0}
    assert _support(logits, top_p=0.79) == {0, 1}
    assert _support(logits, top_p=0.81) == {0, 1, 2}


@pytest.mark.parametrize("candidates", [16, 1024])
def test_top_p_over_the_most_likely_keeps_the_sorts_nucleus(candidates, monkeypatch) -> None:
    # A large vocabulary sorts only its most likely tokens when they hold top_p: the same
    # kept set as the whole sort, and the whole sort where they do not.
    from pagedserve.engine.sample.sampler import top_p_drop

    v = 40 * candidates
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(3)) * 4
    logits[1] *= 3  # a peaked row
    probs = torch.softmax(logits, dim=-1)
    mass = probs.sort(dim=-1, descending=True).values[:, : candidates - 1].sum(-1)
    within = torch.full((4,), 0.9) * mass.min()  # every row's nucleus among the candidates
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    for top_p, fast in ((within, True), (torch.tensor([0.2, 0.6, 0.95, 0.999]), False)):
        sorts.clear()
        got = top_p_drop(probs, top_p, candidates)
        assert (not sorts) == fast
        want = top_p_drop(probs, top_p, candidates=0)
        assert torch.equal(got, want)
        kept = (~got).sum(-1)
        assert (kept >= 1).all() and (kept < v).all()


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert _support(logits, min_p=0.2) == {0, 1, 2}  # 0.05 < 0.2 * 0.5
    assert _support(logits, min_p=0.7) == {0}


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = rand_logits(2)
    best = logits[0].argmax().item()
    out = Sampler(V)(
        logits,
        [
            row(temperature=0.0, logit_bias={best: -100.0}),
            row(temperature=0.0, logit_bias={11: 100.0}),
        ],
    )
    assert out.token_ids[0] != best
    assert out.token_ids[1] == 11


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0  # EOS
    logits[0, 9] = 9.0  # a stop token
    logits[0, 4] = 1.0

    def pick(output: list[int], **kw) -> int:
        r = row(output=output, temperature=0.0, min_tokens=3, stop_token_ids=[9], **kw)
        r.eos_token_ids = (2,)
        return Sampler(V)(logits, [r]).token_ids[0]

    assert pick([5]) == 4
    assert pick([5, 5, 5]) == 2
    # ignore_eos: EOS ends nothing, so only the stop token is masked.
    assert pick([5], ignore_eos=True) == 2


def test_repetition_penalty_matches_transformers() -> None:
    logits = rand_logits(2)
    prompt, output = [3, 5, 5, 60], [7, 3, 11]
    r = row(prompt=prompt, output=output, repetition_penalty=1.7)
    ours = logits.clone()
    penalties.apply_all(ours, [r, row(prompt=prompt, output=output)], StagingBuffer("cpu"))
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[:1].clone())
    assert torch.allclose(ours[0], hf[0])
    assert torch.equal(ours[1], logits[1])  # the row without penalties is untouched


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    logits = rand_logits(1)
    output = [4, 4, 4, 9]
    r = row(prompt=[4, 20], output=output, presence_penalty=0.5, frequency_penalty=0.25)
    ours = logits.clone()
    penalties.apply_all(ours, [r], StagingBuffer("cpu"))
    expected = logits.clone()
    expected[0, 4] -= 3 * 0.25 + 0.5
    expected[0, 9] -= 1 * 0.25 + 0.5
    assert torch.allclose(ours, expected)  # prompt-only token 20 is not penalised


def test_logprobs_come_from_raw_distribution() -> None:
    logits = rand_logits(3, seed=9)
    rows = [
        row(temperature=0.5, seed=1, logprobs=5, repetition_penalty=1.5),
        row(temperature=0.0),
        row(temperature=0.0, logprobs=0),
    ]
    out = Sampler(V)(logits, rows)
    raw = torch.log_softmax(logits, -1)
    lp0 = out.logprobs[0]
    assert lp0 is not None and lp0.token_id == out.token_ids[0]
    assert math.isclose(lp0.logprob, raw[0, out.token_ids[0]].item(), rel_tol=1e-5)
    top = raw[0].topk(5)
    assert [c.token_id for c in lp0.top] == top.indices.tolist()
    assert [c.rank for c in lp0.top] == [1, 2, 3, 4, 5]
    assert all(
        math.isclose(c.logprob, v, rel_tol=1e-5)
        for c, v in zip(lp0.top, top.values.tolist(), strict=True)
    )
    assert out.logprobs[1] is None
    assert out.logprobs[2] is not None and out.logprobs[2].top == []
    assert out.token_ids[2] == logits[2].argmax().item()
