"""The offline API as a user sees it: sampling, n, stops, errors, dtype."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.sampling_params import SamplingParamError
from pagedserve.engine.errors import InputField, PromptTooLongError, TokenIdError
from pagedserve.engine.worker import hugepages

PROMPTS = [
    "The three most important inventions of the twentieth century are",
    "Here is a short poem about the sea:",
    "def quicksort(arr):",
    "My favourite recipe for a rainy day is",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory_gb=0.25, max_num_batched_tokens=64)


def test_kv_cache_is_one_huge_page_aligned_pool(llm):
    from pagedserve.kernels.cpu import abi
    from pagedserve.kernels.cpu.native import kv_layout

    cache = llm.engine.worker.kv_cache
    assert cache.data_ptr() % hugepages.HUGE_PAGE == 0
    # In the layout of the backend that reads it: the native kernel streams each KV
    # head's rows of a block as one run.
    heads_first = llm.engine.worker.attn.name == "cpu"
    assert kv_layout(cache[0, 0]) == (abi.KV_HEADS_FIRST if heads_first else abi.KV_ROWS_FIRST)
    # The engine's start applied and recorded the process tuning (huge pages among it).
    assert llm.engine.tuning.hugepages is hugepages.enabled()
    assert llm.engine.tuning.summary().startswith("process tuning: OpenMP spin ")


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_outputs_in_input_order_with_metadata(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == PROMPTS
    for o, p in zip(outs, PROMPTS, strict=False):
        assert o.finished and o.prompt_token_ids == tok.encode(p)
        c = o.outputs[0]
        assert c.index == 0 and c.finish_reason in ("stop", "length")
        assert len(c.token_ids) <= 8
        assert o.metrics.first_token_time >= o.metrics.arrival_time
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_seeded_sampling_independent_of_batch(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234)
    alone = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, seed=7 + i) for i in range(3)]
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]],
                         [others[0], sp, others[1], others[2]], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate(PROMPTS[1], sp.clone(seed=99), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=12),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_stop_strings_never_appear(llm):
    base = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for o in base:
        text = o.outputs[0].text
        if len(text) < 6:
            continue
        stop = text[3:6]  # appears in the greedy text: must end the output right before it
        out = llm.generate(o.prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert stop not in out.text
        assert out.text == text[: text.find(stop)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        kept = llm.generate(o.prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                     include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
        assert kept.text == text[: text.find(stop) + len(stop)]
        # Logprobs cover the tokens whose text is out, not the stop string's.
        with_lp = llm.generate(o.prompt, SamplingParams(temperature=0, max_tokens=24,
                                                        stop=[stop], logprobs=0),
                               use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert with_lp.token_ids == out.token_ids
        n = len(with_lp.logprobs)
        assert n < len(with_lp.token_ids)
        assert [lp.token_id for lp in with_lp.logprobs] == list(with_lp.token_ids[:n])
        assert out.text.startswith(llm.get_tokenizer().decode(with_lp.token_ids[:n]))


def test_output_ending_inside_a_character_keeps_its_text(llm):
    """Text held back for an unfinished character is released at the end, as U+FFFD
    (what a full decode gives)."""
    tok = llm.get_tokenizer()
    first = tok.encode("\U0001F600", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0, max_tokens=1, logit_bias={first: 100.0})
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "length"
    assert out.text == tok.decode([first]) == "\ufffd"


def test_stop_token_text_kept_with_include_stop_str_in_output(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0]
    stop = base.token_ids[3]
    tok = llm.get_tokenizer()
    for include in (False, True):
        out = llm.generate(PROMPTS[0], SamplingParams(
            temperature=0, max_tokens=8, stop_token_ids=[stop],
            include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        n = base.token_ids.index(stop) + 1
        assert out.token_ids == base.token_ids[:n] and out.stop_reason == stop
        assert out.text == tok.decode(out.token_ids if include else out.token_ids[:-1])


def test_stop_string_may_begin_before_min_tokens(llm):
    """A stop string that begins in the first token's text and ends in the second's
    stops the output at ``min_tokens=2``."""
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0]
    first, two = tok.decode(base.token_ids[:1]), tok.decode(base.token_ids[:2])
    assert len(first) >= 1 and len(two) > len(first)
    stop = two[len(first) - 1:]
    assert stop not in two[:-1]  # completed by the second token, not before
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, min_tokens=2,
                                                  stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == first[:-1] and out.token_ids == base.token_ids[:2]


def test_unbounded_max_tokens_fits_the_cache(llm):
    """``max_tokens=None`` runs to the end of the context or of the KV cache, whichever
    comes first, instead of being refused for a cache smaller than the context."""
    eng = llm.engine
    capacity = eng.kv.num_blocks * eng.settings.block_size
    assert capacity < eng.settings.max_model_len  # the fixture's 0.25 GiB cache
    assert eng.check_length(10, SamplingParams(max_tokens=None)) == capacity - 10
    with pytest.raises(PromptTooLongError, match="leaves no room") as e:
        eng.check_length(capacity, SamplingParams(max_tokens=None))
    assert e.value.field is InputField.PROMPT


def test_prompt_dicts_and_chat_content_parts(llm):
    g = SamplingParams(temperature=0, max_tokens=6)
    plain = llm.generate(PROMPTS[0], g, use_tqdm=False)[0]
    as_dict = llm.generate({"prompt": PROMPTS[0]}, g, use_tqdm=False)[0]
    assert as_dict.prompt == PROMPTS[0]
    assert as_dict.outputs[0].token_ids == plain.outputs[0].token_ids
    text = llm.chat([{"role": "user", "content": "Say hi."}], g, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}], g,
                     use_tqdm=False)[0]
    assert parts.prompt_token_ids == text.prompt_token_ids
    assert parts.outputs[0].token_ids == text.outputs[0].token_ids
    # The last (assistant) message left open for the model to continue.
    cont = llm.chat([{"role": "user", "content": "Say hi."},
                     {"role": "assistant", "content": "Hel"}], g, use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True,
                    chat_template_kwargs={"unused_flag": True})[0]
    assert cont.prompt.endswith("<|im_start|>assistant\nHel")
    with pytest.raises(ValueError, match=r"messages\[0\]\[0\]\.content\[0\] must be a text part"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], g, use_tqdm=False)
    with pytest.raises(ValueError, match="string 'role'"):
        llm.chat([{"content": "hi"}], g, use_tqdm=False)
    assert llm.engine.kv.stats().num_used_blocks == 0
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate(["a", "b"], [g, {"max_tokens": 3}], use_tqdm=False)


def test_n_gives_n_outputs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=3),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_n_without_prefix_caching_forks_prompt_blocks():
    llm = LLM(dtype="float32", kv_cache_memory_gb=0.25, enable_prefix_caching=False)
    prompt = " ".join(["word"] * 60)
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=6), use_tqdm=False)
    one = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert all(c.token_ids == one[0].outputs[0].token_ids for c in out[0].outputs)
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_logprobs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tid, lp in zip(out.token_ids, out.logprobs, strict=False):
        assert lp.token_id == tid and len(lp.top) == 3
        assert lp.top[0].rank == 1 and lp.top[0].token_id == tid  # greedy = rank 1
        assert lp.logprob <= 0
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    # vLLM's access pattern: per position, token id -> Logprob, with decoded text.
    tok = llm.get_tokenizer()
    first = out.logprobs[0]
    assert first[out.token_ids[0]].logprob == first.logprob and first.rank == 1
    assert list(first) == [c.token_id for c in first.top] and len(first) == 3
    assert all(first[t].decoded == tok.decode([t]) for t in first)
    # Sampled at a high temperature, the sampled token may be outside the top 1: it is
    # still in the mapping, with its rank.
    hot = llm.generate(PROMPTS[0], SamplingParams(temperature=5.0, seed=3, max_tokens=8,
                                                  logprobs=1), use_tqdm=False)[0].outputs[0]
    for tid, lp in zip(hot.token_ids, hot.logprobs, strict=True):
        assert tid in lp and lp[tid].logprob == lp.logprob and lp[tid].rank == lp.rank >= 1
        assert lp[tid].decoded == tok.decode([tid])
        assert (lp.rank == 1) == (lp.top[0].token_id == tid)
    assert any(lp.rank > 1 for lp in hot.logprobs)


def test_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}],
                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"logit_bias": {5.7: 1.0}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"repetition_penalty": 3e-299}, "repetition_penalty"),  # infinite logits otherwise
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
])
def test_sampling_params_types_are_checked(kwargs, param):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and str(e.value).startswith(f"{param}=")


def test_logit_bias_keys_may_be_decimal_strings():
    assert SamplingParams(logit_bias={"12": 1, 7: -2}).logit_bias == {12: 1.0, 7: -2.0}


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"kv_cache_memory_gb": float("nan")}, "kv_cache_memory_gb"),
    ({"kv_cache_memory_gb": float("inf")}, "kv_cache_memory_gb"),
    ({"max_num_seqs": "4"}, "max_num_seqs"),
    ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ({"block_size": 16.0}, "block_size"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
])
def test_engine_arguments_types_are_checked(kwargs, name):
    """Refused when the config is built, before any model is loaded."""
    with pytest.raises(ValueError, match=f"^{name}="):
        EngineConfig.from_kwargs(**kwargs)


def test_bad_inputs_name_the_parameter(llm):
    with pytest.raises(TypeError, match="unknown engine argument.*not_a_flag"):
        LLM(not_a_flag=1)
    with pytest.raises(SamplingParamError, match="temperature") as e:
        SamplingParams(temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(SamplingParamError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(SamplingParamError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(PromptTooLongError, match="maximum context length is 8192"):
        llm.generate("hi", SamplingParams(max_tokens=9000), use_tqdm=False)
    with pytest.raises(TokenIdError, match="out of range"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, SamplingParams(), use_tqdm=False)
    # A rejected batch queues nothing.
    assert not llm.engine.has_unfinished_requests()


def test_bfloat16_on_cpu():
    llm = LLM(dtype="bfloat16", kv_cache_memory_gb=0.1)
    assert llm.engine.worker.kv_cache.dtype == torch.bfloat16
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1 and out[0].outputs[0].text


def test_failed_step_errors_its_requests_and_keeps_serving(llm):
    ref = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    eng = llm.engine
    real = eng.worker.execute
    calls = {"n": 0}

    def failing(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real(sched)

    eng.reset_prefix_cache()
    eng.worker.execute = failing
    try:
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)
    finally:
        eng.worker.execute = real
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    stats = eng.kv.stats()
    assert stats.num_used_blocks == 0 and stats.num_cached_blocks == 0  # nothing unwritten hit
    eng.kv.check_invariants()
    again = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert texts(again) == texts(ref)
