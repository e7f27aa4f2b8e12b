"""vLLM's ``allowed_token_ids`` and ``bad_words``: the sampler masks every other token,
or a bad word's last token once the output ends with its other tokens; greedy rows with
either leave the plain-argmax path; the server names the field of a bad value."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core.sampling_params import SamplingParamError
from pagedserve.engine.sample.penalties import bad_word_bans, bad_word_sequences

PROMPTS = ["The weather today is", "def f(x):"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path, make_tiny):
    path = make_tiny("llama", tmp_path_factory.mktemp("masks"), default_model_path)
    return LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.02)


def _tokens(llm, prompt, **kw):
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **kw)
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_allowed_tokens_are_sampled(tiny, temperature):
    allowed = [300, 301, 4000, 12345]
    for prompt in PROMPTS:
        out = _tokens(tiny, prompt, temperature=temperature, seed=1, allowed_token_ids=allowed)
        assert len(out) == 12 and set(out) <= set(allowed), out


def test_a_bad_words_last_token_is_masked_after_its_prefix(tiny):
    prompt = PROMPTS[0]
    free = _tokens(tiny, prompt, temperature=0)
    j = next(k for k in range(1, 11) if free[k - 1] not in free[:k - 1])
    out = _tokens(tiny, prompt, temperature=0, bad_words_token_ids=[[free[j - 1], free[j]]])
    assert out[:j] == free[:j] and out[j] != free[j]
    for a, b in zip(out, out[1:], strict=False):
        assert (a, b) != (free[j - 1], free[j])
    first = _tokens(tiny, prompt, temperature=0, bad_words_token_ids=[[free[0]]])
    assert free[0] not in first


def test_bad_words_are_tokenized_alone_and_after_a_space(default_tokenizer):
    tok = default_tokenizer
    seqs = bad_word_sequences(tok, ["hello world", " Paris"])
    for text in ("hello world", " hello world", "Paris", " Paris"):
        assert tok.encode(text, add_special_tokens=False) in seqs
    assert bad_word_bans([[5], [7, 8, 9], [8, 3], [2, 3]], [1, 7, 8]) == [5, 9, 3]
    assert bad_word_bans([[7, 8, 9]], [8]) == []


def test_the_engine_fills_bad_words_token_ids(tiny):
    sp = SamplingParams(max_tokens=3, bad_words=["weather"])
    tiny.generate(["a"], sp, use_tqdm=False)
    assert sp.bad_words_token_ids == bad_word_sequences(tiny.engine.tokenizer, ["weather"])


@pytest.mark.parametrize("kw, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"bad_words": ["ok", "  "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids"),
])
def test_bad_values_name_the_field(kw, message):
    with pytest.raises(SamplingParamError, match=message) as e:
        SamplingParams(**kw)
    assert e.value.param == message


def test_the_server_applies_and_checks_them(tmp_path, default_model_path, make_tiny):
    from pagedserve import EngineConfig
    from pagedserve.engine.loop.llm_engine import LLMEngine
    from pagedserve.server.options import ServeOptions
    from tests.helpers.server import run_in_process

    path = make_tiny("llama", tmp_path / "m", default_model_path)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32",
                                                kv_cache_memory_gb=0.02))
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}

    async def script(client):
        out = []
        for extra in ({"allowed_token_ids": [300, 4000]},
                      {"allowed_token_ids": [300, 10**6]}, {"bad_words": [3]},
                      {"bad_words": ["the"]}):
            r = await client.post("/v1/completions", json={**body, **extra})
            out.append((r.status, await r.json()))
        return out

    (ok, good), (s1, e1), (s2, e2), (s3, _) = run_in_process(engine, ServeOptions(), script)
    assert ok == 200 and s3 == 200
    pieces = {tiny_piece for tiny_piece in good["choices"][0]["logprobs"]["tokens"]}
    assert pieces <= {engine.token_text(300), engine.token_text(4000)}
    assert s1 == 400 and e1["error"]["param"] == "allowed_token_ids"
    assert s2 == 400 and e2["error"]["param"] == "bad_words"


def test_ids_outside_the_vocabulary_are_refused(tiny):
    from pagedserve import EngineInputError

    for kw, field in (({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                      ({"bad_words_token_ids": [[5, 10**7]]}, "bad_words_token_ids")):
        with pytest.raises(EngineInputError, match="outside|not all inside") as e:
            tiny.generate(["a"], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
        assert e.value.param == field
    assert tiny.engine.kv.stats().num_used_blocks == 0
