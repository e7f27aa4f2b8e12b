"""Sampling parameters, validated on construction.

Every error is a :class:`~pagedserve.engine.errors.SamplingParamError` naming the field, the value
and the allowed range. A ``SamplingParams`` is never changed after construction: what
the engine resolves for a request (its token limit, the model's EOS ids) lives on the
request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.errors import SamplingParamError
from pagedserve.engine.structured.params import StructuredOutputsParams

__all__ = ["MAX_LOGPROBS", "SamplingParamError", "SamplingParams", "StructuredOutputsParams"]

MAX_LOGPROBS = 20
MIN_REPETITION_PENALTY = 0.01
"""A repeated token's positive logit is divided by the penalty: far below this it leaves
float32's range (a penalty of 1e-40 is 0 in float32), and the row's logits are infinite."""
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}")
"""A ``logit_bias`` key given as text: the ASCII decimal of a token id."""


PRIORITY_LIMIT = 2**31
MAX_BAD_WORDS = 100


def _err(param: str, value: Any, limit: str) -> SamplingParamError:
    return SamplingParamError(param, f"{param}={value!r} is invalid: {limit}")


def _as_list(param: str, value: Any, limit: str) -> list:
    """None as [], a list or tuple as a list; anything else is an error naming ``param``."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    raise _err(param, value, limit)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None = up to the end of the context; 0 = compute the prompt, generate nothing
    (with ``prompt_logprobs``: score a text)."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Number of top logprobs per sampled token (0 = only the sampled one)."""
    prompt_logprobs: int | None = None
    """Number of top logprobs per prompt token (0 = only the prompt token's own); each
    prompt token's logprob given the tokens before it. A request asking for them reads
    nothing from the prefix cache (every prompt token is computed)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar."""
    priority: int = 0
    """Under ``scheduling_policy="priority"``: lower runs first (ties in arrival order);
    any other value than 0 is refused under ``fcfs``."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled (vLLM's extra)."""
    bad_words: list[str] | None = None
    """Words the output must not contain (vLLM's extra): the last token of a word is
    masked when the output ends with the word's other tokens; each word as the
    tokenizer spells it alone and after a space (the engine fills
    ``bad_words_token_ids``)."""
    bad_words_token_ids: list[list[int]] | None = None
    """The token sequences that are masked; set directly, or by the engine from
    ``bad_words``."""

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else _as_list(
            "stop", self.stop, "must be a string or a list of strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids,
                                       "must be a list of token ids")
        self._validate_token_lists()
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1 or self.n > 128:
            raise _err("n", self.n, "must be an integer in [1, 128]")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise _err("temperature", self.temperature, "must be in [0, 100]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _err("top_p", self.top_p, "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise _err("top_k", self.top_k, "must be -1, 0 (disabled) or a positive integer")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _err("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise _err("seed", self.seed, "must be an integer")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise _err(name, v, "must be in [-2, 2]")
        if (not is_num(self.repetition_penalty)
                or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0):
            raise _err("repetition_penalty", self.repetition_penalty,
                       f"must be in [{MIN_REPETITION_PENALTY}, 2]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _err("logit_bias", self.logit_bias, "must map token ids to biases")
            clean: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                # An int, or the decimal string of one (JSON object keys are strings).
                if is_int(k):
                    tid = k
                elif isinstance(k, str) and _TOKEN_ID_KEY.fullmatch(k.strip()):
                    tid = int(k)
                else:
                    raise _err("logit_bias", k, "keys must be integer token ids")
                if not is_num(v) or not -100.0 <= v <= 100.0:
                    raise _err("logit_bias", v, "biases must be in [-100, 100]")
                clean[tid] = float(v)
            self.logit_bias = clean
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _err("stop", s, "stop strings must be non-empty strings")
        if len(self.stop) > 16:
            raise _err("stop", len(self.stop), "at most 16 stop strings")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise _err("stop_token_ids", t, "must be non-negative integers")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            raise _err("max_tokens", self.max_tokens, "must be an integer >= 0")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise _err("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _err("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _err("logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
                not is_int(self.prompt_logprobs)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise _err("prompt_logprobs", self.prompt_logprobs,
                       f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not is_int(self.priority) or not -PRIORITY_LIMIT <= self.priority < PRIORITY_LIMIT:
            raise _err("priority", self.priority,
                       f"must be an integer in [{-PRIORITY_LIMIT}, {PRIORITY_LIMIT})")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, getattr(self, name), "must be true or false")
        self._validate_structured()

    def _validate_token_lists(self) -> None:
        """``allowed_token_ids``, ``bad_words`` and ``bad_words_token_ids``."""
        def ids_ok(v: Any) -> bool:
            return (isinstance(v, (list, tuple)) and len(v) > 0 and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v))

        if self.allowed_token_ids is not None:
            if not ids_ok(self.allowed_token_ids):
                raise _err("allowed_token_ids", self.allowed_token_ids,
                           "must be a non-empty list of token ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or len(self.bad_words) > \
                    MAX_BAD_WORDS or not all(isinstance(w, str) and w.strip()
                                             for w in self.bad_words):
                raise _err("bad_words", self.bad_words,
                           f"must be a list of at most {MAX_BAD_WORDS} non-blank strings")
            self.bad_words = list(self.bad_words)
        seqs = self.bad_words_token_ids
        if seqs is not None:
            if not isinstance(seqs, (list, tuple)) or not all(ids_ok(s) for s in seqs):
                raise _err("bad_words_token_ids", seqs,
                           "must be a list of non-empty lists of token ids")
            self.bad_words_token_ids = [list(s) for s in seqs]

    def _validate_structured(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise _err("structured_outputs", so, "must be a StructuredOutputsParams")
        # The grammar decides where the output ends: it ends on an EOS token.
        if self.min_tokens:
            raise _err("min_tokens", self.min_tokens,
                       "must be 0 with structured_outputs (the grammar decides the end)")
        if self.ignore_eos:
            raise _err("ignore_eos", self.ignore_eos,
                       "must be false with structured_outputs (the grammar ends on EOS)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: Any) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)
