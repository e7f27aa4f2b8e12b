"""The sampler's host work: one staging per step, no device tensor built from a Python
list, and penalty token counts kept on the device, updated with the new tokens only."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.sample import penalties
from pagedserve.engine.sample.sampler import Sampler, SamplingRow, make_generator
from pagedserve.engine.step_buffers import Pack, StagingBuffer

V = 96


class OnlyTokens:
    """A grammar matcher that allows a fixed set of tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = torch.zeros(bitmask.shape[1], dtype=torch.int64)
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = words.to(torch.int32)  # wraps bit 31 like the int32 words do

    def accept_token(self, token_id: int) -> bool:
        return token_id in self.allowed


def _row(key: str | None = None, prompt=(1, 2, 3), output=(), matcher=None, **kw):
    p = SamplingParams(**kw)
    return SamplingRow(p, list(prompt), list(output), make_generator(p), eos_token_ids=(2,),
                       matcher=matcher, key=key)  # fmt: skip


def _mixed_rows() -> list[SamplingRow]:
    """Every path of the sampler in one batch, with plain greedy rows among them."""
    return [
        _row("a", temperature=0.0),
        _row("b", output=[4, 4, 7], temperature=0.0, repetition_penalty=1.3,
             presence_penalty=0.4, frequency_penalty=0.2),
        _row("c", output=[5], temperature=0.9, seed=3, top_k=5, top_p=0.8, min_p=0.05,
             logprobs=2),
        _row("d", temperature=1.1, logit_bias={7: 5.0, 9: -100.0}, min_tokens=4,
             stop_token_ids=[11]),
        _row("e", temperature=0.0, logprobs=0, matcher=OnlyTokens([3, 40, 70])),
        _row("f", temperature=0.0),
    ]


def test_a_step_stages_once_and_builds_no_tensor_from_lists(monkeypatch) -> None:
    sampler = Sampler(V)
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3
    rows = _mixed_rows()
    expected = Sampler(V)(logits, _mixed_rows())  # before torch.tensor is taken away
    sampler(logits, rows)
    stages = sampler.staging.num_stages

    def refuse(*args, **kwargs):
        raise AssertionError("a per-step tensor was built from host values")

    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch, "as_tensor", refuse)
    out = sampler(logits, _mixed_rows())
    assert sampler.staging.num_stages == stages + 1
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[4] in (3, 40, 70)
    assert out.token_ids[3] != 2 and out.token_ids[3] != 11  # min_tokens bans EOS and stop
    assert out.logprobs[2] is not None and len(out.logprobs[2].top) == 2
    assert out.logprobs[4] is not None and out.logprobs[0] is None
    # Seeded and greedy rows do not depend on anything else in the batch.
    for i in (0, 1, 2, 4, 5):
        assert out.token_ids[i] == expected.token_ids[i]


def test_device_counts_give_the_tokens_of_counting_afresh() -> None:
    """Rows with keys (counts kept between steps) and rows without (counted each step)
    pick the same tokens over a run of steps that grows, finishes and reuses rows."""
    g = torch.Generator().manual_seed(1)
    keyed, fresh = Sampler(V), Sampler(V)
    outputs: dict[str, list[int]] = {}
    live = [f"r{i}" for i in range(12)]  # more than the initial rows of the counts
    params = dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7,
                  frequency_penalty=0.9)  # fmt: skip
    for step in range(9):
        if step == 4:  # two finish; a new request reuses a released row
            for rid in live[:2]:
                keyed.release(rid)
                outputs.pop(rid)
            live = live[2:] + ["late"]
        logits = torch.randn(len(live), V, generator=g)
        prompts = {rid: [len(rid) * 7 % V, sum(map(ord, rid)) % V, 6] for rid in live}
        rows_k = [_row(rid, prompts[rid], outputs.setdefault(rid, []), **params) for rid in live]
        rows_f = [_row(None, prompts[rid], outputs[rid], **params) for rid in live]
        got_k, got_f = keyed(logits, rows_k).token_ids, fresh(logits, rows_f).token_ids
        assert got_k == got_f, step
        for rid, t in zip(live, got_k, strict=True):
            outputs[rid].append(t)
    counts = keyed.counts
    assert counts.num_rows >= 11
    for rid in live:  # counted up to the last step's input (its sampled token is next)
        row = counts.rows.row_of[rid]
        expect = torch.bincount(torch.tensor(outputs[rid][:-1]), minlength=V).to(torch.int32)
        assert torch.equal(counts.counts[row], expect), rid


def test_counts_upload_only_the_new_tokens() -> None:
    counts = penalties.TokenCounts(V, "cpu", num_rows=2)
    staging = StagingBuffer("cpu")
    prompt = [1, 2, 3, 4]
    r = _row("x", prompt, [9, 9], repetition_penalty=1.2)
    out = r.output_token_ids
    sizes = []
    for new in ([], [8], [8, 9, 10]):
        out.extend(new)
        pack = Pack()
        plan = counts.plan([r], pack)
        sizes.append((len(pack.arrays[plan.prompt_idx][0]), len(pack.arrays[plan.out_idx][0])))
        c, seen = plan.tensors(staging.stage(pack.arrays))
        assert c[0].tolist() == torch.bincount(torch.tensor(out), minlength=V).tolist()
        assert seen[0].nonzero().flatten().tolist() == prompt
    assert sizes == [(4, 2), (0, 1), (0, 3)]  # the prompt once, then only new tokens
    # A key seen again with a shorter output (a new request under an old id) is recounted.
    pack = Pack()
    plan = counts.plan([_row("x", [7], [5], repetition_penalty=1.2)], pack)
    c, seen = plan.tensors(staging.stage(pack.arrays))
    assert c[0].nonzero().flatten().tolist() == [5] and seen[0].nonzero().flatten().tolist() == [7]


@pytest.mark.parametrize("mixed", [False, True])
def test_unseeded_and_seeded_rows_share_a_batch(mixed: bool) -> None:
    """Seeded rows reproduce whatever else is in the batch; unseeded rows still sample."""
    logits = torch.zeros(4, V)
    rows = [_row(f"s{i}", temperature=1.0, seed=i if (mixed or i % 2) else None)
            for i in range(4)]  # fmt: skip
    a = Sampler(V)(logits, rows).token_ids
    rows2 = [_row(f"s{i}", temperature=1.0, seed=i if (mixed or i % 2) else None)
             for i in range(4)]  # fmt: skip
    b = Sampler(V)(logits, rows2).token_ids
    assert all(0 <= t < V for t in a)
    seeded = [i for i in range(4) if mixed or i % 2]
    assert [a[i] for i in seeded] == [b[i] for i in seeded]
