"""The input checks every front end shares (``pagedserve.engine.loop.engine_info.InputLimits``) and the
typed errors they raise."""

from __future__ import annotations

import pytest

from pagedserve.engine.core.sampling_params import SamplingParamError, SamplingParams
from pagedserve.engine.errors import EngineInputError, InputField, PromptTooLongError, TokenIdError
from pagedserve.engine.loop.engine_info import InputLimits

V = 100


def limits(**kw) -> InputLimits:
    base = dict(vocab_size=V, max_model_len=256, num_kv_blocks=8, block_size=16,
                max_num_batched_tokens=64, enable_chunked_prefill=True)
    return InputLimits(**{**base, **kw})


def test_sampling_token_ids_outside_the_vocabulary_name_their_field() -> None:
    lim = limits()
    lim.check_sampling_token_ids(SamplingParams(logit_bias={5: 1.0}, stop_token_ids=[3]))
    with pytest.raises(TokenIdError) as e:
        lim.check_sampling_token_ids(SamplingParams(logit_bias={V: 1.0}))
    assert e.value.field is InputField.LOGIT_BIAS and "outside [0, 100)" in str(e.value)
    with pytest.raises(TokenIdError) as e:
        lim.check_sampling_token_ids(SamplingParams(stop_token_ids=[V + 1]))
    assert e.value.field is InputField.STOP_TOKEN_IDS


@pytest.mark.parametrize("bad", [-1, V, 10**12, True, 2.0, "3"])
def test_prompt_token_ids_are_checked(bad) -> None:
    with pytest.raises(TokenIdError) as e:
        limits().check_token_ids([1, 2, bad])
    assert e.value.field is InputField.PROMPT and repr(bad) in str(e.value)
    limits().check_token_ids([0, V - 1])


def test_max_tokens_resolution_and_the_field_at_fault() -> None:
    lim = limits()
    assert lim.resolve_max_tokens(10, SamplingParams(max_tokens=5)) == 5
    # None: the context or the whole cache (8 blocks x 16 = 128 tokens), whichever is less.
    assert lim.resolve_max_tokens(10, SamplingParams(max_tokens=None)) == 118
    assert limits(max_model_len=64).resolve_max_tokens(10, SamplingParams(max_tokens=None)) == 54
    with pytest.raises(PromptTooLongError) as e:
        lim.resolve_max_tokens(0, SamplingParams())
    assert e.value.field is InputField.PROMPT and "empty" in str(e.value)
    with pytest.raises(PromptTooLongError) as e:  # the limit alone is too large
        lim.resolve_max_tokens(10, SamplingParams(max_tokens=250))
    assert e.value.field is InputField.MAX_TOKENS and "maximum context length is 256" in str(e.value)
    with pytest.raises(PromptTooLongError) as e:  # the prompt alone fills the context
        lim.resolve_max_tokens(256, SamplingParams(max_tokens=1))
    assert e.value.field is InputField.PROMPT
    with pytest.raises(PromptTooLongError) as e:  # more blocks than the cache has
        lim.resolve_max_tokens(100, SamplingParams(max_tokens=100))
    assert e.value.field is InputField.MAX_TOKENS and "whole cache has 8 blocks" in str(e.value)
    with pytest.raises(PromptTooLongError) as e:
        limits(enable_chunked_prefill=False).resolve_max_tokens(60, SamplingParams(max_tokens=10))
    assert e.value.field is InputField.PROMPT and "max_num_batched_tokens=64" in str(e.value)
    with pytest.raises(EngineInputError) as e:  # min_tokens beyond the resolved limit
        limits(max_model_len=20).resolve_max_tokens(10, SamplingParams(max_tokens=None,
                                                                       min_tokens=11))
    assert e.value.field is InputField.MIN_TOKENS


def test_sampling_param_errors_are_engine_input_errors() -> None:
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(top_p=0)
    assert isinstance(e.value, EngineInputError) and e.value.field is InputField.TOP_P
    assert e.value.param == "top_p"
    # Every SamplingParams field has its InputField.
    assert {f.value for f in InputField} >= set(SamplingParams.__dataclass_fields__)


@pytest.mark.parametrize("key", ["\u00b2", "--5", "5" * 5000, "1e3", " ", "\u0665"])
def test_logit_bias_text_keys_that_are_not_decimal_ids_are_refused(key) -> None:
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(logit_bias={key: 1.0})
    assert e.value.field is InputField.LOGIT_BIAS
    assert SamplingParams(logit_bias={" 12 ": 1.0, "-0": 2.0}).logit_bias == {12: 1.0, 0: 2.0}
