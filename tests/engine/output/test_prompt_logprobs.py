"""Prompt logprobs: each prompt token's logprob given the tokens before it, as HF
transformers computes it, however the prompt is chunked, preempted or shared."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.helpers.hf import PROMPT_LOGPROB_TOL as TOL
from tests.helpers.hf import hf_prompt_logprobs
from tests.helpers.prompts import PROMPTS

K = 3


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    ids = [default_tokenizer.encode(p) for p in PROMPTS]
    ids.append(list(range(1000, 1150)))  # 150 random ids: the prompt is unlikely text
    return ids


@pytest.fixture(scope="module")
def reference(default_model_path, prompts):
    return hf_prompt_logprobs(default_model_path, prompts, K)


def check(outs, prompts, reference) -> None:
    tol = TOL
    for out, p, (chosen, ranks, top_v, top_i) in zip(outs, prompts, reference, strict=True):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(p) and plp[0] is None
        for i, e in enumerate(plp[1:]):
            assert e.token_id == p[i + 1]
            assert abs(e.logprob - chosen[i]) < tol, (i, e.logprob, chosen[i])
            assert ranks[i][0] <= e.rank <= ranks[i][1], (i, e.rank, ranks[i])
            assert [c.rank for c in e.top] == list(range(1, K + 1))
            v = top_v[i]
            for r, c in enumerate(e.top):
                assert abs(c.logprob - v[r]) < tol, (i, r, c, v)
                # The same token, unless HF's neighbours are within the tolerance.
                tied = (r > 0 and v[r - 1] - v[r] < tol) or v[r] - v[r + 1] < tol
                assert c.token_id == top_i[i][r] or tied, (i, r, c, top_i[i])
            assert e[p[i + 1]].logprob == e.logprob  # a mapping, as vLLM's dicts are


def greedy(prompt_logprobs: int | None = K, n: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, prompt_logprobs=prompt_logprobs)


def generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_chunked_prompts_in_a_mixed_batch_match_hf_and_never_read_the_cache(
        prompts, reference):
    # A small token budget chunks the long prompts and mixes decodes with prefill chunks.
    llm = LLM(dtype="float32", max_num_batched_tokens=24)
    plain = generate(llm, prompts, greedy(None, n=16))
    assert all(o.prompt_logprobs is None for o in plain)
    outs = generate(llm, prompts, greedy(n=16))
    check(outs, prompts, reference)
    # The prompts were cached by the first run; asking for their logprobs computes them.
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    again = generate(llm, prompts, greedy(None, n=1))
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 16)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_preempted_prompts_report_each_position_once(prompts, reference,
                                                     default_model_path):  # fmt: skip
    # 40 blocks of 16 tokens cannot hold 9 requests of up to 150 + 48 tokens at once.
    llm = LLM(dtype="float32", num_gpu_blocks_override=40, max_num_batched_tokens=64,
              enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=48, min_tokens=48, prompt_logprobs=K)
    outs = generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    check(outs, prompts, reference)
    assert llm.engine.kv.num_free_blocks == 40
    # 20 blocks: the second prompt (250 tokens) is still being chunked in when the first
    # one's decode needs a block; it is preempted halfway and computed again.
    two = [list(range(2000, 2150)), list(range(3000, 3250))]
    llm = LLM(dtype="float32", num_gpu_blocks_override=20, max_num_batched_tokens=32,
              enable_prefix_caching=False)  # fmt: skip
    preempted_at = []
    preempt = llm.engine.scheduler._preempt

    def record(req, preempted):
        preempted_at.append(req.num_computed_tokens < req.num_prompt_tokens)
        preempt(req, preempted)

    llm.engine.scheduler._preempt = record
    outs = generate(llm, two, params)
    assert any(preempted_at), preempted_at  # one was preempted during its prompt
    check(outs, two, hf_prompt_logprobs(default_model_path, two, K))


def test_siblings_share_one_list_with_texts_and_offsets(prompts, reference,
                                                        default_tokenizer):  # fmt: skip
    tok = default_tokenizer
    llm = LLM(dtype="float32")
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=K)
    outs = generate(llm, prompts[:3], params)
    check(outs, prompts[:3], reference[:3])
    for out, p in zip(outs, prompts[:3], strict=True):
        assert len(out.outputs) == 3
        for i, e in enumerate(out.prompt_logprobs[1:], start=1):
            assert e.decoded == tok.decode([p[i]])
            assert e.text_offset == len(tok.decode(p[:i]))  # where it begins in the prompt
            assert all(c.decoded == tok.decode([c.token_id]) for c in e.top)


def test_streamed_outputs_carry_them_once(prompts, reference):
    from pagedserve.engine.output.processor import OUTPUT_DELTA

    llm = LLM(dtype="float32", max_num_batched_tokens=24)
    engine = llm.engine
    engine.add_request("r", prompts[0], greedy(n=6), output_kind=OUTPUT_DELTA)
    got = []
    while engine.has_unfinished_requests():
        got += [o.prompt_logprobs for o in engine.step()]
    carried = [g for g in got if g is not None]
    assert len(got) == 6 and len(carried) == 1
    check([type("Out", (), {"prompt_logprobs": carried[0]})], prompts[:1], reference[:1])


def test_a_one_token_prompt_has_only_its_none():
    llm = LLM(dtype="float32")
    (out,) = generate(llm, [[42]], greedy())
    assert out.prompt_logprobs == [None]


def test_max_tokens_0_scores_a_prompt_that_fills_the_context(prompts, reference):
    """Nothing is generated: the prompt is computed, its logprobs come back, and a
    prompt of the whole context fits."""
    llm = LLM(dtype="float32", max_model_len=len(prompts[-1]), max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=0, prompt_logprobs=K, n=2)
    outs = generate(llm, prompts, sp)
    check(outs, prompts, reference)
    for o in outs:
        assert [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] == \
            [([], "", "length")] * 2
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    plain = generate(llm, prompts[:2], SamplingParams(max_tokens=0))  # a cache warm-up
    assert all(o.outputs[0].finish_reason == "length" and o.prompt_logprobs is None
               for o in plain)  # fmt: skip
    with pytest.raises(ValueError, match="max_tokens=-1"):
        SamplingParams(max_tokens=-1)
