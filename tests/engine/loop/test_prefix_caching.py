"""Prefix caching at the engine level: same tokens, shared blocks, salts kept apart."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

SYSTEM = (
    "You are a careful assistant for a logistics company. Answer in short sentences, cite "
    "the relevant policy number when there is one, and never invent tracking numbers. "
    "Policies: 1. Parcels over 30 kg ship by freight. 2. Refunds take five working days. "
)
QUESTIONS = ["Where is my parcel?", "Can I ship a piano?", "How long do refunds take?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    tok = default_tokenizer
    system = tok.encode(SYSTEM)
    assert len(system) > 40
    out = [system + tok.encode(" " + q) for q in QUESTIONS]  # shared prefix, mid-block end
    for cut in (20, 37, 41):  # prefixes ending mid-block, then a different tail
        out.append(system[:cut] + tok.encode(" Tell me a joke about trucks."))
    out.append(list(out[0]))  # identical: entirely cached but the last token on a warm run
    return out


def _gen(llm: LLM, prompts, **kw):
    return llm.generate([{"prompt_token_ids": p, **kw} for p in prompts], GREEDY, use_tqdm=False)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_outputs_identical_off_cold_warm(prompts):
    off = _tokens(_gen(LLM(dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=32), prompts))
    llm = LLM(dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=32)
    cold = _gen(llm, prompts)
    warm = _gen(llm, prompts)
    assert _tokens(cold) == off
    assert _tokens(warm) == off
    # Warm: every prompt is served from the cache up to its last full block, but the
    # last prompt token is always computed.
    for p, o in zip(prompts, warm, strict=False):
        assert o.num_cached_tokens == (len(p) - 1) // 16 * 16
    stats = llm.engine.kv.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries >= stats.prefix_cache_hits
    llm.engine.kv.check_invariants()
    assert stats.num_used_blocks == 0


def test_shared_prefix_shares_physical_blocks(prompts):
    shared = prompts[:3]  # same system prompt, different questions

    def peak_blocks(enable: bool) -> tuple[int, int]:
        llm = LLM(dtype="float32", enable_prefix_caching=enable)
        eng = llm.engine
        for p in shared:
            eng.add_request(None, p, GREEDY)
        peak, max_ref = 0, 0
        while eng.has_unfinished_requests():
            eng.step()
            peak = max(peak, eng.kv.stats().num_used_blocks)
            max_ref = max([max_ref, *eng.kv.pool.ref_counts])
            eng.kv.check_invariants()
        return peak, max_ref

    peak_on, ref_on = peak_blocks(True)
    peak_off, ref_off = peak_blocks(False)
    assert ref_on == 3 and ref_off == 1
    common = 0
    while all(p[common] == shared[0][common] for p in shared):
        common += 1
    # Each of the two later requests reuses the first one's full prefix blocks.
    assert peak_off - peak_on == 2 * (common // 16)


def test_cache_salt_never_shares(prompts):
    llm = LLM(dtype="float32", enable_prefix_caching=True)
    a = _gen(llm, prompts[:1], cache_salt="tenant-a")
    b = _gen(llm, prompts[:1], cache_salt="tenant-b")
    again = _gen(llm, prompts[:1], cache_salt="tenant-a")
    assert a[0].num_cached_tokens == 0 and b[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens > 0
    assert _tokens(a) == _tokens(b) == _tokens(again)


def test_reset_prefix_cache(prompts):
    llm = LLM(dtype="float32", enable_prefix_caching=True)
    _gen(llm, prompts[:1])
    assert llm.reset_prefix_cache()
    assert _gen(llm, prompts[:1])[0].num_cached_tokens == 0
