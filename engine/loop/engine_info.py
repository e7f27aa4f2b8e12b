"""What a front end may know of a running engine: :class:`EngineInfo`, and the input
checks of :class:`InputLimits` (the one implementation of the length and token-id
checks, which the engine applies at admission and a server may apply before it answers).

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.blockmgr import cdiv
from pagedserve.blockmgr.groups import KVGroups
from pagedserve.engine.core.pooling import PoolingParams
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.errors import EngineInputError, InputField, PromptTooLongError, TokenIdError
from pagedserve.engine.jsonlimits import read_json_file
from pagedserve.engine.lora.request import LoRALimits


@dataclass(frozen=True, slots=True)
class InputLimits:
    """The limits every request is checked against."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    hidden_size: int = 0
    """The model's hidden size: the length of its embeddings."""
    kv_groups: KVGroups | None = None
    """The KV groups (None: one full-attention group): a request's blocks are its peak
    over every group's table."""

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one request can hold in the whole KV cache."""
        if self.kv_groups is None:
            return self.num_kv_blocks * self.block_size
        return self.kv_groups.capacity_tokens(self.block_size, self.num_kv_blocks,
                                              self.max_num_batched_tokens,
                                              max(self.max_model_len, 1))  # fmt: skip

    def kv_blocks_needed(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once."""
        if self.kv_groups is None:
            return cdiv(num_tokens, self.block_size)
        return self.kv_groups.peak_blocks(self.block_size, num_tokens,
                                          self.max_num_batched_tokens)  # fmt: skip

    def check_token_ids(self, ids: list[int], field: InputField = InputField.PROMPT) -> None:
        """Every id an integer in ``[0, vocab_size)``; else a :class:`TokenIdError`."""
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise TokenIdError(f"token id {t!r} is out of range [0, {vocab})", field)

    def check_sampling_token_ids(self, params: SamplingParams) -> None:
        """``logit_bias`` keys and ``stop_token_ids`` inside the vocabulary."""
        vocab = self.vocab_size
        for tid in params.logit_bias or {}:
            if not 0 <= tid < vocab:
                raise TokenIdError(f"logit_bias token id {tid} is outside [0, {vocab})",
                                   InputField.LOGIT_BIAS)  # fmt: skip
        for tid in params.stop_token_ids or ():
            if not 0 <= tid < vocab:
                raise TokenIdError(f"stop_token_ids entry {tid} is outside [0, {vocab})",
                                   InputField.STOP_TOKEN_IDS)  # fmt: skip
        for tid in params.allowed_token_ids or ():
            if not 0 <= tid < vocab:
                raise TokenIdError(f"allowed_token_ids entry {tid} is outside [0, {vocab})",
                                   InputField.ALLOWED_TOKEN_IDS)  # fmt: skip
        for seq in params.bad_words_token_ids or ():
            if not all(0 <= tid < vocab for tid in seq):
                raise TokenIdError(f"bad_words_token_ids entry {seq} is not all inside [0, "
                                   f"{vocab})", InputField.BAD_WORDS_TOKEN_IDS)  # fmt: skip

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's limit on output tokens: ``params.max_tokens``, or with None what
        the context and the KV cache leave. Raises :class:`PromptTooLongError` naming the
        prompt or ``max_tokens``."""
        prompt = InputField.PROMPT
        if num_prompt_tokens == 0:
            raise PromptTooLongError("the prompt is empty: at least one token is required",
                                     prompt)  # fmt: skip
        room = self.max_model_len - num_prompt_tokens
        capacity = self.kv_capacity_tokens
        if params.max_tokens is None:
            max_tokens = self._fill(num_prompt_tokens, room, capacity)
        else:
            max_tokens = params.max_tokens
            if num_prompt_tokens + max_tokens > self.max_model_len:
                raise PromptTooLongError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                    f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
                    f"Please reduce the length of the prompt or the completion.",
                    prompt if room < 1 else InputField.MAX_TOKENS)
        need = self.kv_blocks_needed(num_prompt_tokens + max_tokens)
        if need > self.num_kv_blocks:
            raise PromptTooLongError(
                f"the request needs {need} KV cache blocks ({num_prompt_tokens} prompt + "
                f"{max_tokens} completion tokens) but the whole cache has "
                f"{self.num_kv_blocks} blocks of {self.block_size} tokens",
                InputField.MAX_TOKENS if num_prompt_tokens < capacity else prompt)
        if not self.enable_chunked_prefill and \
                num_prompt_tokens + max_tokens > self.max_num_batched_tokens:
            raise PromptTooLongError(
                f"with chunked prefill off, prompt + completion ({num_prompt_tokens + max_tokens}) "
                f"must fit max_num_batched_tokens={self.max_num_batched_tokens}", prompt)
        if params.min_tokens > max_tokens:
            raise EngineInputError(
                f"min_tokens={params.min_tokens} is larger than the token limit {max_tokens}",
                InputField.MIN_TOKENS)
        return max_tokens

    def _fill(self, num_prompt_tokens: int, room: int, capacity: int) -> int:
        """No limit given: up to the end of the context, or of what the whole KV cache
        (and, with chunked prefill off, one step) can hold."""
        if room < 1:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {num_prompt_tokens} tokens, which leaves no room "
                f"for a completion.", InputField.PROMPT)
        limit = capacity if self.enable_chunked_prefill else \
            min(capacity, self.max_num_batched_tokens)  # fmt: skip
        max_tokens = min(room, limit - num_prompt_tokens)
        if max_tokens < 1:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens, which leaves no room for a "
                f"completion in the {limit} tokens one request can hold (the KV cache "
                f"has {self.num_kv_blocks} blocks of {self.block_size} tokens)",
                InputField.PROMPT)
        return max_tokens


GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The ``generation_config.json`` fields that are sampling defaults."""


def generation_defaults(model_path: str | Path) -> dict[str, Any]:
    """The sampling defaults a model's ``generation_config.json`` sets (e.g. Qwen3's
    temperature 0.6, top_p 0.95, top_k 20); empty without the file."""
    path = Path(model_path) / "generation_config.json"
    try:
        config = read_json_file(path)
    except (OSError, ValueError):  # JSONTextError too
        return {}
    if not isinstance(config, dict):
        return {}
    return {k: config[k] for k in GENERATION_FIELDS
            if isinstance(config.get(k), (int, float)) and not isinstance(config[k], bool)}


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """All a front end reads of the engine: names, limits and the tokenizer."""

    model_name: str
    model_path: str
    tokenizer: Any
    """The Hugging Face tokenizer (chat template, encode, decode)."""
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    limits: InputLimits
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    """The model's own sampling defaults (:func:`generation_defaults`)."""
    lora: LoRALimits | None = None
    """What a LoRA adapter must fit (``enable_lora``); None: LoRA is off."""
    pooling_defaults: PoolingParams = field(default_factory=PoolingParams)
    """How the model pools an embedding by default (:func:`pagedserve.engine.core.pooling.pooling_defaults`)."""

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size
