"""Request state inside the engine.

One ``Request`` is one sequence being generated. A user request with ``n > 1`` becomes
``n`` sibling ``Request``s that share a ``group`` (and, through the prefix cache or
``KVCacheManager.fork``, the physical blocks of their prompt).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.core.outputs import RequestMetrics, TokenLogprobs
from pagedserve.engine.core.pooling import PoolingParams
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.lora.request import LoRARequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_GRAMMAR = 3
    """Its structured-output grammar is compiling: the scheduler skips it."""
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    WAITING_FOR_KV_LOAD = 8
    """The KV block store is reading blocks of its prompt: the scheduler skips it until
    the load is done (:mod:`pagedserve.engine.core.kv_tier`)."""

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class RequestGroup:
    """What the ``n`` siblings of one user request share."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    members: list[Request] = field(default_factory=list)
    error: Exception | None = None
    """Why the request failed before it ran (a grammar that did not compile)."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """When asked for: an entry per prompt token after the first, as they are computed."""
    prompt_logprobs_sent: bool = False
    """A streamed request's prompt logprobs went out (with its first output after them)."""
    pooling: PoolingParams | None = None
    """An embedding request's pooling (resolved); its vector goes to ``embedding``."""
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(m.status.finished for m in self.members)

    @property
    def needs_whole_prompt(self) -> bool:
        """Every prompt token must be computed (no prefix cache hits): prompt logprobs
        or a pooling over all of them are not all in yet."""
        pool = self.pooling
        return self.prompt_logprobs_pending or (
            pool is not None and pool.whole_prompt and self.embedding is None)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs were asked for and are not all in yet."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < len(self.prompt_token_ids) - 1


@dataclass(eq=False)
class Request:
    request_id: str
    group: RequestGroup
    index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    max_tokens: int
    """Resolved limit on output tokens (``params.max_tokens``, or what the context and
    the KV cache leave)."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's EOS ids: the request stops on them unless ``params.ignore_eos``."""
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    lora_waited_steps: int = 0
    """Steps this request waited first in line for a place for its adapter
    (:func:`pagedserve.engine.core.lora_slots.lora_gate`)."""
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission (-1 = not yet)."""
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprobs] | None = None
    logprob_text_ends: list[int] = field(default_factory=list)
    """Per entry of ``logprobs``: the length of the text fed to the stop checker once that
    token's text was in (the entry is output once ``output_text`` is that long)."""
    text_fed: int = 0
    """Characters fed to the stop checker so far (the output text and what it holds)."""
    detok: Any = None
    """The output processor's incremental detokenizer."""
    stop_checker: Any = None
    """The output processor's stop-string checker."""
    output_text: str = ""
    metrics: RequestMetrics | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed for the next step (speculative decoding); not yet the
    request's tokens."""
    # What the model side was last sent (the scheduler's diffs are against these).
    runner_knows: bool = False
    num_sent_tokens: int = 0
    num_sent_blocks: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def lora_key(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.cache_key

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 without one."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
