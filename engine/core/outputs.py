"""Values that cross the engine boundary: per-request results and metrics."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One candidate token with its log-probability (rank 1 = most likely)."""

    token_id: int
    logprob: float
    rank: int
    decoded: str | None = None


@dataclass(slots=True)
class TokenLogprobs(Mapping[int, Logprob]):
    """The sampled token's logprob and the top candidates at that position.

    Also a read-only mapping ``token id -> Logprob`` over the candidates and the sampled
    token, as vLLM's per-position dicts are (``out.logprobs[i][token_id].logprob``).
    """

    token_id: int
    logprob: float
    top: list[Logprob]
    rank: int | None = None
    """The sampled token's rank in the distribution (1 = most likely)."""
    decoded: str | None = None
    """The sampled token's text alone (filled by the engine)."""
    text_offset: int | None = None
    """Where the token's text begins in the output text, in characters (filled by the
    engine; the tokens of one character all begin where it does)."""

    def _entries(self) -> dict[int, Logprob]:
        entries = {c.token_id: c for c in self.top}
        if self.token_id not in entries:
            entries[self.token_id] = Logprob(self.token_id, self.logprob, self.rank or 0,
                                             self.decoded)  # fmt: skip
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    """"stop", "length", "abort" or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output, None for EOS/length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = field(default=None)
    error: Exception | None = None
    """Set when the request failed before it ran: an ``EngineInputError`` naming the
    field (e.g. a structured-output constraint that does not compile)."""
    embedding: list[float] | None = None
    """An embedding request's vector, once its prompt is computed."""
