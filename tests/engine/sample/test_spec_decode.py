"""N-gram speculative decoding: the proposer, the verification, and the engine with
speculation on giving what it gives with speculation off."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.sample.ngram_proposer import NgramProposer
from pagedserve.engine.sample.rejection_sampler import Span, verify
from pagedserve.engine.sample.sampler import SamplingRow
from pagedserve.engine.speculative import SpeculativeConfig
from pagedserve.engine.step_buffers import StagingBuffer


# -- proposer ---------------------------------------------------------------------------
def test_proposer_takes_the_longest_ngram_and_its_latest_occurrence() -> None:
    p = NgramProposer(3, 1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # "5 6" occurs at 0 and 4: the latest (4) is followed by 8 2 5.
    assert p.propose(toks) == [8, 2, 5]
    # A longer n-gram wins over a later short one: "9 5 6" only at 0.
    toks = [9, 5, 6, 7, 7, 3, 5, 6, 1, 1, 9, 5, 6]
    assert p.propose(toks) == [7, 7, 3]
    assert p.propose(toks, max_drafts=1) == [7]
    assert p.propose(toks, max_drafts=0) == []


def test_proposer_edge_cases() -> None:
    p = NgramProposer(4, 2, 3)
    assert p.propose([]) == [] and p.propose([1, 2]) == []
    assert p.propose([1, 2, 3, 4]) == []  # no earlier occurrence of "3 4"
    assert p.propose([1, 2, 1, 2]) == [1, 2]  # the match's follow-up runs to the end
    # Bytes that match across a token boundary are not a match: 0x200 then 0 hold the
    # bytes of a 2 one byte in (00 02 00 00 | 00 ...), later than the real 2 at index 0.
    assert NgramProposer(2, 1, 1).propose([2, 7, 0x200, 0, 5, 2]) == [7, 0x200]
    assert NgramProposer(2, 1, 1).propose([7, 0x200, 0, 5, 2]) == []


def test_speculative_config_is_checked_and_parsed() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                  '"prompt_lookup_max": 5}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 2, 5)
    assert SpeculativeConfig.parse({"prompt_lookup_max": 1}).prompt_lookup_min == 1
    for bad, msg in (({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_spec"),
                     ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                     ({"k": 2}, "unknown key"), ("[1]", "must be a dict"),
                     ("{bad json", "JSON")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)


# -- verification ---------------------------------------------------------------------
def _rows(n: int, **params) -> list[SamplingRow]:
    sp = SamplingParams(**params)
    return [SamplingRow(sp, [1], [], None) for _ in range(n)]


def test_greedy_verification_keeps_the_agreeing_prefix() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 4, 9, 1]):
        logits[row, tok] = 5.0
    rows = _rows(4, temperature=0.0)
    got, _, bad = verify(logits, rows, [Span(0, [3, 4, 5])], 10, StagingBuffer("cpu"))
    assert bad == []
    assert got == [[3, 4, 9]]  # 5 disagrees with row 2's 9: 9 is the next token
    got, _, bad = verify(logits, rows, [Span(0, [3, 4, 9])], 10, StagingBuffer("cpu"))
    assert bad == []
    assert got == [[3, 4, 9, 1]]  # all kept, and row 3 gives one more


def test_verification_names_requests_whose_kept_tokens_are_not_finite() -> None:
    """A span whose output tokens include one scored by a NaN row is named; a NaN row
    behind a rejected draft is never read, and its span is not."""
    logits = torch.full((7, 10), -5.0)
    for row, tok in enumerate([2, 0, 0, 5, 0, 0, 8]):
        logits[row, tok] = 5.0
    logits[1] = float("nan")  # span 0: behind draft 3, which row 0 (argmax 2) rejects
    logits[4] = float("nan")  # span 1: behind draft 5, which row 3 keeps
    spans = [Span(0, [3, 4]), Span(3, [5, 6]), Span(6, [])]
    for params in (dict(temperature=0.0), dict(temperature=1.0, seed=5)):
        rows = [SamplingRow(SamplingParams(**params), [1], [], None) for _ in range(7)]
        for s in spans:  # a seeded request's rows share its generator
            gen = torch.Generator().manual_seed(7) if "seed" in params else None
            for i in range(s.start, s.start + len(s.drafts) + 1):
                rows[i].generator = gen
        got, _, bad = verify(logits, rows, spans, 10, StagingBuffer("cpu"))
        assert bad == [1], params
        if "seed" not in params:
            assert got[0] == [2] and got[2] == [8]
        # One NaN logit in the row that scores span 2's only token: its distribution is
        # NaN everywhere, whatever token a draw then lands on.
        one = logits.clone()
        one[6, 3] = float("nan")
        got, _, bad = verify(one, rows, spans, 10, StagingBuffer("cpu"))
        assert bad == [1, 2], params


def _chi2_p_value(observed: list[int], expected: list[float]) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty approximation)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    k = sum(1 for e in expected if e > 0) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Over many seeded draws, the first token is distributed as row 0's distribution and
    the second, given the first was the draft, as row 1's; whatever the drafts are."""
    vocab = 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 1.5
    p = torch.softmax(logits, dim=-1)
    trials = 6000
    first = [0] * vocab
    second = [0] * vocab
    n_second = 0
    for i in range(trials):
        gen = torch.Generator().manual_seed(1000 + i)
        rows = [SamplingRow(SamplingParams(temperature=1.0, seed=i), [1], [], gen)
                for _ in range(3)]  # fmt: skip
        drafts = [int(p[0].argmax()), int(p[1].argmin())]  # a likely and an unlikely draft
        out = verify(logits, rows, [Span(0, drafts)], vocab, StagingBuffer("cpu"))[0][0]
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
            n_second += 1
    assert _chi2_p_value(first, [trials * float(q) for q in p[0]]) > 1e-3
    assert _chi2_p_value(second, [n_second * float(q) for q in p[1]]) > 1e-3


# -- the engine -----------------------------------------------------------------------
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 64}  # fmt: skip


def _outputs(llm: LLM, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_outputs_are_the_same_with_speculation(arch, tiny_model_factory,
                                                      default_tokenizer) -> None:  # fmt: skip
    path = str(tiny_model_factory(arch))
    words = "a b c d e f g a b c d e f g a b c the end".split()
    prompts = [{"prompt_token_ids": default_tokenizer.encode(" ".join(words[i:] * 3))}
               for i in range(5)]  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    cases = [
        ({}, greedy),
        ({}, greedy.clone(n=3, seed=1)),
        ({}, greedy.clone(stop=[" c", "g a"], ignore_eos=False, min_tokens=5)),
        ({}, greedy.clone(max_tokens=9, logprobs=2)),
        ({}, greedy.clone(repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=12,
                          ignore_eos=False)),
        # Forced preemption (a tiny cache) and prefix caching off.
        ({"num_gpu_blocks_override": 12, "max_num_batched_tokens": 64,
          "enable_prefix_caching": False}, greedy),
    ]
    drafted = accepted = 0
    for kwargs, params in cases:
        base = LLM(model=path, dtype="float32", **kwargs)
        spec = LLM(model=path, dtype="float32", speculative_config=SPEC, **kwargs)
        want = _outputs(base, prompts, params)
        # Twice: the second run hits the prefix cache (where it is on).
        for _ in range(2):
            assert _outputs(spec, prompts, params) == want, (kwargs, params)
        st = spec.engine.scheduler.spec_stats
        drafted += st.num_draft_tokens
        accepted += st.num_accepted_tokens
        assert spec.engine.kv.stats().num_free_blocks == spec.engine.kv.num_blocks
        if "num_gpu_blocks_override" in kwargs:
            assert spec.engine.scheduler.num_preemptions > 0 and st.num_draft_tokens > 0
    assert drafted > accepted  # rejected drafts (random weights rarely copy: the default
    # model's test below covers kept ones)


TEXT = ("The committee met on Tuesday to discuss the budget, the schedule and the new "
        "office. After a long debate they agreed to move the office to the second floor.")
COPY_PROMPTS = [f"Repeat the following text exactly:\n{TEXT}\nRepeated text:\n",
                f"Summarize in one sentence: {TEXT}", "def fibonacci(n):"]


@pytest.mark.parametrize("kwargs", [{}, {"num_gpu_blocks_override": 7,
                                         "max_num_batched_tokens": 96}])
def test_default_model_gguf_is_the_same_with_speculation(kwargs) -> None:
    """The default model copies text, so drafts are kept: stop strings, max_tokens and
    min_tokens that land inside kept drafts, n > 1, logprobs, prefix-cache hits and
    (second case) forced preemption behave as without speculation."""
    base = LLM(quantization="gguf", kv_cache_memory_gb=0.1, **kwargs)
    spec = LLM(quantization="gguf", kv_cache_memory_gb=0.1, speculative_config=SPEC, **kwargs)
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    cases = [greedy, greedy.clone(stop=["agreed", "second"]), greedy.clone(max_tokens=13),
             greedy.clone(n=2, seed=3, stop=["Tuesday"], include_stop_str_in_output=True),
             greedy.clone(stop_token_ids=[30], min_tokens=20), greedy.clone(logprobs=1)]
    if kwargs:
        cases = cases[:2]
    for i, params in enumerate(cases):
        want = _outputs(base, COPY_PROMPTS, params)
        for _ in range(2 if i == 0 else 1):  # a second run hits the prefix cache
            assert _outputs(spec, COPY_PROMPTS, params) == want, params
    st = spec.engine.scheduler.spec_stats
    assert st.num_accepted_tokens > 0.2 * st.num_draft_tokens > 0  # copying is kept
    assert spec.engine.kv.stats().num_free_blocks == spec.engine.kv.num_blocks
    if kwargs:
        assert spec.engine.scheduler.num_preemptions > 0


def test_logprobs_with_speculation_match() -> None:
    """Logprobs of kept drafts are the model's own, as without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=3)
    base = LLM(quantization="gguf", kv_cache_memory_gb=0.1)
    llm = LLM(quantization="gguf", kv_cache_memory_gb=0.1, speculative_config=SPEC)
    a = base.generate(COPY_PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].logprobs
    b = llm.generate(COPY_PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].logprobs
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 10
    assert [x.token_id for x in a] == [x.token_id for x in b]
    assert [x.rank for x in a] == [x.rank for x in b]
    assert [[c.token_id for c in x.top] for x in a] == [[c.token_id for c in x.top] for x in b]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True)) < 1e-3


def test_seeded_sampling_with_speculation_keeps_the_distribution(tiny_model_factory,
                                                                 default_tokenizer) -> None:  # fmt: skip
    """Sampled 3-token continuations with speculation on and off come from the same
    distribution (a two-sample chi-square over 1536 draws each). The sampling support is
    three tokens of the prompt (a large equal ``logit_bias`` and ``top_k=3``: the model's
    own logits set their odds), so prompt lookup proposes drafts that are kept or
    rejected at random: 27 outcomes."""
    path = str(tiny_model_factory("qwen2"))
    ids = default_tokenizer.encode(" a b c a c b c a b b a c")
    support = sorted(set(ids))
    assert len(support) == 3
    prompt = {"prompt_token_ids": ids}
    counts = []
    for spec in (None, SPEC):
        llm = LLM(model=path, dtype="float32", speculative_config=spec)
        seen: dict[tuple[int, ...], int] = {}
        for seed in range(48):  # n=32: within disable_by_batch_size
            params = SamplingParams(n=32, temperature=1.0, top_k=3, max_tokens=3, seed=seed,
                                    ignore_eos=True, logit_bias={t: 50.0 for t in support})
            for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs:
                assert set(c.token_ids) <= set(support)
                seen[tuple(c.token_ids)] = seen.get(tuple(c.token_ids), 0) + 1
        if spec is not None:
            st = llm.engine.scheduler.spec_stats
            assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st
        counts.append(seen)
    keys = sorted(set(counts[0]) | set(counts[1]))
    a = [counts[0].get(k, 0) for k in keys]
    b = [counts[1].get(k, 0) for k in keys]
    stat = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b, strict=True) if x + y)
    k = sum(1 for x, y in zip(a, b, strict=True) if x + y) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    assert 0.5 * math.erfc(z / math.sqrt(2)) > 1e-3, (stat, k)
