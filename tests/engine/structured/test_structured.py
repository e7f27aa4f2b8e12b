"""Structured outputs in the engine, with each grammar backend: outputs match their JSON
schema, regex, choice or grammar; constrained rows leave their neighbours untouched;
compiles run off the engine thread, are cached, and fail only their own request."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsError, StructuredOutputsParams
from pagedserve.engine.core.request import RequestStatus
from pagedserve.engine.core.sampling_params import SamplingParamError
from pagedserve.engine.structured import backend as backend_mod
from pagedserve.engine.structured.bitmask import fill

S = StructuredOutputsParams
# Strings bounded by patterns (bounds by maxLength are covered in test_structured_schema).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                 "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{0,9}$"}},
                    "required": ["city"]},
        "nickname": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    },
    "required": ["name", "age", "color", "tags", "address"],
}
PROMPTS = ["The weather today is", "Once upon a time", "def f(x):", "Numbers: 1, 2, 3,"]
BACKENDS = ["xgrammar", "llguidance"]
COMPILE_ERRORS = {  # each backend's words for a bad regex and an unknown schema type
    "xgrammar": ("parenthesis is not closed", "Unsupported type"),
    "llguidance": ("unclosed group", "Invalid type: frob"),
}


@pytest.fixture(scope="module", params=BACKENDS)
def tiny(request, tmp_path_factory, default_model_path, make_tiny):
    """A random Llama whose logits have 64 padding rows past the tokenizer's tokens:
    unconstrained, it produces anything but valid JSON."""
    path = make_tiny("llama", tmp_path_factory.mktemp("tiny-padded"), default_model_path,
                     vocab_size=49152 + 64)
    return LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.05,
               max_num_batched_tokens=256, structured_outputs_backend=request.param)


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def test_json_schema_outputs_validate_on_a_random_model(tiny):
    sp = SamplingParams(temperature=1.0, max_tokens=200, seed=5, n=3,
                        structured_outputs=S(json=PERSON))
    outs = tiny.generate(PROMPTS, sp, use_tqdm=False)
    assert len(texts(outs)) == 12
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text  # the grammar ended it, on EOS
            jsonschema.validate(json.loads(c.text), PERSON)
            assert "\n" not in c.text  # fixed whitespace
            assert max(c.token_ids) < 49152  # padding rows of the vocabulary are masked
    # n=3: each sibling owns its matcher; their random streams differ.
    assert len(set(texts(outs[:1]))) == 3
    assert tiny.engine.kv.stats().num_used_blocks == 0


def test_regex_choice_grammar_and_json_object_at_temperature_one(tiny):
    cases = [
        (S(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (S(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (S(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")"'),
         lambda t: re.fullmatch(r"\([a-c]{1,3}\)", t)),
    ]
    for spec, ok in cases:
        sp = SamplingParams(temperature=1.0, max_tokens=60, n=4, seed=1,
                            structured_outputs=spec)
        for o in tiny.generate(PROMPTS, sp, use_tqdm=False):
            for c in o.outputs:
                assert ok(c.text) and c.finish_reason == "stop", (spec, c.text)
    sp = SamplingParams(temperature=1.0, max_tokens=60, n=4, seed=1,
                        structured_outputs=S(json_object=True))
    outs = [c for o in tiny.generate(PROMPTS, sp, use_tqdm=False) for c in o.outputs]
    assert any(c.finish_reason == "stop" for c in outs)
    for c in outs:  # an object, or the start of one cut by max_tokens
        assert isinstance(json.loads(c.text), dict) if c.finish_reason == "stop" else \
            c.text.startswith("{")


def test_unconstrained_neighbours_are_untouched(tiny):
    """32 requests in one batch, half constrained: the greedy half is what it is alone."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = texts(tiny.generate(PROMPTS, greedy, use_tqdm=False))
    cons = [SamplingParams(temperature=1.0, max_tokens=200, seed=i,
                           structured_outputs=S(json=PERSON)) for i in range(16)]
    mixed = tiny.generate(PROMPTS * 8, [p for c in cons for p in (greedy, c)],
                          use_tqdm=False)
    got = texts(mixed)
    assert got[0::2] == [alone[i % 4] for i in range(0, 32, 2)]
    for o in mixed[1::2]:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert tiny.engine.kv.stats().num_used_blocks == 0


def test_logprobs_are_the_models_distribution(tiny):
    free = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    cons = free.clone(structured_outputs=S(choice=["w"]))
    a = tiny.generate(PROMPTS[0], free, use_tqdm=False)[0].outputs[0].logprobs[0]
    b = tiny.generate(PROMPTS[0], cons, use_tqdm=False)[0].outputs[0].logprobs[0]
    assert [(x.token_id, x.logprob) for x in a.top] == [(x.token_id, x.logprob) for x in b.top]
    assert b.token_id == tiny.get_tokenizer().encode("w")[0] != a.token_id


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_leaves_constrained_output_unchanged(tiny_model_factory, backend):
    path = tiny_model_factory("llama")
    sp = [SamplingParams(temperature=0.8, seed=i, max_tokens=120,
                         structured_outputs=S(json=PERSON)) for i in range(6)]
    prompts = [p * 8 for p in PROMPTS[:3]] * 2
    roomy = LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.05,
                structured_outputs_backend=backend)
    want = texts(roomy.generate(prompts, sp, use_tqdm=False))
    tight = LLM(model=str(path), dtype="float32", num_gpu_blocks_override=24,
                max_num_batched_tokens=64, enable_prefix_caching=False,
                structured_outputs_backend=backend)
    assert texts(tight.generate(prompts, sp, use_tqdm=False)) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.stats().num_free_blocks == 24


def test_compiles_off_the_engine_thread_cached_and_skipped_while_waiting(tiny, monkeypatch):
    eng = tiny.engine
    mgr = eng.structured
    seen = []
    real = mgr._compile

    def slow(spec):
        seen.append(threading.current_thread().name)
        time.sleep(0.3)
        return real(spec)

    monkeypatch.setattr(mgr, "_compile", slow)
    spec = S(regex="slow[0-9]{2}")
    sp = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
    eng.add_request("c1", [5, 6, 7], sp)
    eng.add_request("c2", [5, 6, 8], sp)  # same spec: one compile
    eng.add_request("plain", [5, 6, 9], SamplingParams(temperature=0, max_tokens=2))
    outs = eng.step()
    assert eng.scheduler.requests["c1"].status is RequestStatus.WAITING_FOR_GRAMMAR
    assert eng.last_step.num_requests == 1  # the plain request ran; the others wait
    done = {}
    while eng.has_unfinished_requests():
        for o in outs:
            if o.finished:
                done[o.request_id] = o
        outs = eng.step()
    for o in outs:
        done[o.request_id] = o
    assert list(done)[0] == "plain"
    for rid in ("c1", "c2"):
        assert re.fullmatch("slow[0-9]{2}", done[rid].outputs[0].text)
    assert len(seen) == 1 and seen[0].startswith("grammar")  # one compile, in the pool


def test_bad_spec_fails_its_request_alone(tiny):
    eng = tiny.engine
    bad = SamplingParams(max_tokens=4, structured_outputs=S(regex="(unclosed"))
    eng.add_request("bad", [5, 6, 7], bad)
    eng.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    err = done["bad"].error
    bad_regex, bad_type = COMPILE_ERRORS[eng.structured.backend_name]
    assert isinstance(err, StructuredOutputsError) and err.kind == "regex"
    assert str(err).startswith("structured_outputs.regex cannot be compiled: ")
    assert bad_regex in str(err) and ".cc:" not in str(err) and "\n" not in str(err)
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 3
    assert eng.kv.stats().num_used_blocks == 0
    with pytest.raises(StructuredOutputsError, match=r"structured_outputs\.json cannot be "
                                                     f"compiled: .*{bad_type}"):
        tiny.generate("x", SamplingParams(structured_outputs=S(json={"type": "frob"})),
                      use_tqdm=False)


def test_spec_validation():
    with pytest.raises(StructuredOutputsError, match="exactly one of .* got json, regex"):
        S(json={}, regex="a")
    with pytest.raises(StructuredOutputsError, match="exactly one of .* got none"):
        S()
    with pytest.raises(StructuredOutputsError, match=r"structured_outputs\.json is not "
                                                     "valid JSON"):
        S(json="{nope")
    with pytest.raises(StructuredOutputsError, match="choice must be a non-empty list"):
        S(choice=[])
    assert S(json='{"type": "object"}').key == S(json={"type": "object"}).key
    for kw, field in (({"min_tokens": 2}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")):
        with pytest.raises(SamplingParamError, match=f"^{field}=") as e:
            SamplingParams(structured_outputs=S(regex="a"), **kw)
        assert e.value.param == field


def test_missing_backend_package_is_named(monkeypatch):
    monkeypatch.setattr(backend_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StructuredOutputsError, match="need the 'llguidance' package .* "
                                                     r"pip install 'pagedserve\[structured\]'"):
        backend_mod.load_backend("llguidance", None, 10, (2,))


def test_refused_with_speculative_decoding(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.02,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(StructuredOutputsError, match="cannot be combined with speculative"):
        llm.generate("x", SamplingParams(structured_outputs=S(regex="a")), use_tqdm=False)


def test_default_model_json_schema(default_model_path):
    llm = LLM(dtype="float32", kv_cache_memory_gb=0.1, max_num_batched_tokens=256)
    tok = llm.get_tokenizer()
    msgs = [[{"role": "user", "content": f"Describe {who} as JSON."}]
            for who in ("a pirate", "a cat", "a teacher")]
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
               for m in msgs]
    sp = SamplingParams(temperature=0, max_tokens=200, structured_outputs=S(json=PERSON))
    for o in llm.generate(prompts, sp, use_tqdm=False):
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matcher_accepts_rolls_back_and_terminates_on_eos(backend, default_tokenizer):
    tok = default_tokenizer
    eos = tok.eos_token_id
    be = backend_mod.load_backend(backend, tok, 49152 + 64, (eos,))
    m = be.compile(S(choice=["yes", "no"])).matcher()
    yes = tok.encode("yes")
    assert len(yes) == 1 and m.accept_token(yes[0]) and not m.is_terminated()
    allowed = fill([m], 49152 + 64)[0]
    assert [w for w in range(allowed.numel()) if allowed[w]] == [eos // 32]
    assert int(allowed[eos // 32]) == 1 << (eos % 32)  # only EOS may follow "yes"
    assert m.accept_token(eos) and m.is_terminated()
    m.rollback(2)
    assert not m.is_terminated() and not m.accept_token(tok.encode("maybe")[0])
