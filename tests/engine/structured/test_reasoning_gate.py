"""Structured outputs after the reasoning (``StructuredOutputsParams.reasoning``): the
tokens up to the end tag are the model's own, the grammar governs what follows; a start
tag the prompt did not open is allowed as the first token beside the grammar's."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, ReasoningGate, SamplingParams, StructuredOutputsParams
from pagedserve.engine.errors import StructuredOutputsError
from pagedserve.engine.structured.gate import GatedMatcher, allow_token

CHOICES = ("yes", "no", "maybe so")


class _Recorder:
    """A grammar matcher that allows tokens 0..3 and records what it is given."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        bitmask[row, 0] = 0b1111

    def accept_token(self, t):
        if t > 3:
            return False
        self.accepted.append(t)
        return True

    def rollback(self, k):
        del self.accepted[len(self.accepted) - k:]

    def is_terminated(self):
        return self.accepted[-1:] == [0]


def _allowed(m, words=4):
    bm = torch.zeros((1, words), dtype=torch.int32)
    m.fill_bitmask(bm, 0)
    return {32 * w + b for w in range(words) for b in range(32) if int(bm[0, w]) >> b & 1}


def test_gated_matcher_states_and_rollback():
    inner = _Recorder()
    m = GatedMatcher(inner, ReasoningGate(end=(70, 71), start=95))
    assert _allowed(m) == {0, 1, 2, 3, 95}  # the grammar's first tokens, or the start tag
    for t in (95, 40, 70, 41, 70):
        assert m.accept_token(t) and not m.in_grammar
        assert len(_allowed(m)) == 128  # inside the reasoning: anything
    assert m.accept_token(71) and m.in_grammar
    assert inner.accepted == [] and _allowed(m) == {0, 1, 2, 3}
    assert not m.accept_token(50)  # the grammar's verdict, once it applies
    assert m.accept_token(2) and m.accept_token(0) and m.is_terminated()
    m.rollback(3)  # two grammar tokens and the end tag's last token
    assert inner.accepted == [] and not m.in_grammar and not m.is_terminated()
    assert m.accept_token(71) and m.in_grammar
    m.rollback(6)
    assert _allowed(m) == {0, 1, 2, 3, 95}

    inner = _Recorder()
    m = GatedMatcher(inner, ReasoningGate(end=(70,), start=95))
    assert m.accept_token(1) and m.in_grammar and inner.accepted == [1]  # no reasoning
    assert m.accept_token(95) is False  # the start tag is the grammar's to judge now

    m = GatedMatcher(_Recorder(), ReasoningGate(end=(95,), started=True))
    assert not m.in_grammar and len(_allowed(m)) == 128
    assert m.accept_token(95) and m.in_grammar


def test_allow_token_sets_the_sign_bit_of_an_int32_word():
    bm = torch.zeros((2, 2), dtype=torch.int32)
    allow_token(bm, 1, 63)
    allow_token(bm, 1, 32)
    assert bm.tolist() == [[0, 0], [0, -(2**31) + 1]]


def test_a_gate_is_validated():
    with pytest.raises(StructuredOutputsError, match="start token"):
        ReasoningGate(end=(1,))
    with pytest.raises(StructuredOutputsError, match="non-empty tuple"):
        ReasoningGate(end=(), started=True)
    with pytest.raises(StructuredOutputsError, match="ReasoningGate"):
        StructuredOutputsParams(choice=["a"], reasoning=(1,))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path, make_tiny):
    path = make_tiny("llama", tmp_path_factory.mktemp("tiny-gate"), default_model_path)
    return LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.05,
               max_num_batched_tokens=256)


def _tokens(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, **kw),
                        use_tqdm=False)[0].outputs[0]


def _answer(llm, token_ids):
    eos = llm.engine.tokenizer.eos_token_id
    return llm.engine.tokenizer.decode([t for t in token_ids if t != eos])


@pytest.mark.parametrize("prompt", ["The weather today is", "def f(x):"])
def test_the_grammar_applies_after_the_end_tag(tiny, prompt):
    free = _tokens(tiny, prompt, max_tokens=12, ignore_eos=True).token_ids
    # The "end tag": a token of the free output that does not occur before index j.
    j = next(k for k in range(2, 12) if free[k] not in free[:k])
    for gate, kept in ((ReasoningGate(end=(free[j],), started=True), j + 1),
                       (ReasoningGate(end=(free[j],), start=free[0]), j + 1),
                       (ReasoningGate(end=(free[j - 1], free[j]), started=True), j + 1)):
        spec = StructuredOutputsParams(choice=list(CHOICES), reasoning=gate)
        out = _tokens(tiny, prompt, max_tokens=40, structured_outputs=spec)
        assert out.token_ids[:kept] == free[:kept], gate
        assert _answer(tiny, out.token_ids[kept:]) in CHOICES, gate
        assert out.finish_reason == "stop"
    assert tiny.engine.kv.stats().num_used_blocks == 0


def test_without_the_start_tag_first_the_grammar_applies_at_once(tiny):
    prompt = "Once upon a time"
    free = _tokens(tiny, prompt, max_tokens=4, ignore_eos=True).token_ids
    bias = {free[0]: -100.0}  # the start tag is allowed, but the model does not take it
    plain = _tokens(tiny, prompt, max_tokens=40, logit_bias=bias,
                    structured_outputs=StructuredOutputsParams(choice=list(CHOICES)))
    gated = _tokens(tiny, prompt, max_tokens=40, logit_bias=bias,
                    structured_outputs=StructuredOutputsParams(
                        choice=list(CHOICES), reasoning=ReasoningGate(end=(free[1],),
                                                                      start=free[0])))
    assert gated.token_ids == plain.token_ids
    assert _answer(tiny, gated.token_ids) in CHOICES


def test_a_reasoning_cut_by_max_tokens_is_unconstrained(tiny):
    prompt = "Numbers: 1, 2, 3,"
    free = _tokens(tiny, prompt, max_tokens=10).token_ids
    never = next(t for t in range(1000, 2000) if t not in free)
    spec = StructuredOutputsParams(choice=list(CHOICES),
                                   reasoning=ReasoningGate(end=(never,), started=True))
    out = _tokens(tiny, prompt, max_tokens=10, structured_outputs=spec)
    assert out.token_ids == free and len(free) == 10 and out.finish_reason == "length"
