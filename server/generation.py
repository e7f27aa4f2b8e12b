"""One HTTP request's engine requests (one per prompt), iterated as they progress."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve import (
    CompletionOutput,
    EngineDeadError,
    EngineInputError,
    LoRARequest,
    PoolingParams,
    RequestOutput,
    SamplingParams,
    StepItem,
)
from pagedserve.server.errors import APIError, internal, unavailable
from pagedserve.server.param_names import Route, input_error
from pagedserve.server.state import ServerState


class ServerShutdown(Exception):
    """The server is stopping and aborted the request."""


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None


def random_id() -> str:
    return uuid.uuid4().hex


def to_api_error(exc: BaseException, route: Route) -> APIError:
    """The client-facing error for an exception delivered by the engine (input errors
    name the parameter as ``route`` does)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ServerShutdown):
        return unavailable("the server is shutting down; the request was aborted")
    if isinstance(exc, EngineDeadError):
        return internal(str(exc))
    if isinstance(exc, EngineInputError):
        return input_error(exc, route)
    return internal(f"internal error: {exc!r}")


class Generation:
    """Posts one engine request per prompt and yields ``(prompt_index, delta output)``.

    Always :meth:`close` it (``async with``): unfinished requests are aborted, so a
    client that goes away frees its KV blocks at once.
    """

    def __init__(self, state: ServerState, prompts: list[Prompt], params: SamplingParams,
                 route: Route, arrival_time: float, lora: LoRARequest | None = None,
                 pooling: PoolingParams | None = None, cache_salt: str | None = None) -> None:
        """``lora``: the adapter of the served name the request asked for (looked up
        when the request came in: an adapter unloaded since still serves it); ``pooling``:
        embedding requests; ``cache_salt``: the prompts share cached blocks only with
        requests of the same salt."""
        self.state = state
        self.route = route
        self.queue: asyncio.Queue = asyncio.Queue()
        base = random_id()
        self.request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._unfinished: set[str] = set()
        self._last_step: dict[str, float] = {}
        engine = state.engine
        # Admission counts sequences: one request may carry many prompts, each n times.
        state.admit(len(prompts) * params.n)
        try:
            for rid, p in zip(self.request_ids, prompts, strict=True):
                engine.add_request(rid, p.token_ids, params, self.queue, prompt=p.text,
                                   arrival_time=arrival_time, lora_request=lora,
                                   pooling=pooling, cache_salt=cache_salt)
                self._unfinished.add(rid)
        except BaseException as exc:
            self.close()
            raise to_api_error(exc, route) from None

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Abort whatever has not finished."""
        for rid in self._unfinished:
            self.state.engine.abort(rid)
        self._unfinished.clear()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        metrics = self.state.metrics
        while self._unfinished:
            item = await self.queue.get()
            if not isinstance(item, StepItem):
                self.close()
                raise to_api_error(item, self.route)
            out = item.output
            rid = out.request_id
            if rid not in self._unfinished:
                continue
            if any(o.token_ids for o in out.outputs):
                last = self._last_step.get(rid)
                if last is None:
                    metrics.observe_first_token(out.metrics)
                else:
                    metrics.observe_itl(item.step_time - last)
                self._last_step[rid] = item.step_time
            if out.finished:
                self._unfinished.discard(rid)
                metrics.observe_finished(out.metrics)
            yield self._index[rid], out


@dataclass
class ChoiceTally:
    """Token counts gathered while iterating :func:`choice_updates`."""

    completion_tokens: int = 0
    cached: dict[int, int] = field(default_factory=dict)
    """Prompt index -> cached prompt tokens."""
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    """Prompt index -> the engine's prompt logprobs (``[None, entry, ...]``), once in."""

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())


async def choice_updates(
    gen: Generation, n: int, tally: ChoiceTally
) -> AsyncIterator[list[tuple[int, CompletionOutput]]]:
    """Per engine step, the new output of every choice that had not finished, as
    ``(k, output)`` with ``k = prompt index * n + output.index``. A choice that ended in
    ``error`` or ``abort`` raises its API error."""
    finished: set[int] = set()
    async for pidx, out in gen:
        tally.cached[pidx] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            tally.prompt_logprobs[pidx] = out.prompt_logprobs
        updates = []
        for c in out.outputs:
            k = pidx * n + c.index
            if k in finished:
                continue
            raise_if_failed(c.finish_reason)
            tally.completion_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                finished.add(k)
            updates.append((k, c))
        yield updates


def with_finish(choice: dict, c: CompletionOutput) -> dict:
    """``choice`` with ``finish_reason`` (and ``stop_reason`` once finished) of ``c``."""
    choice["finish_reason"] = c.finish_reason
    if c.finish_reason is not None:
        choice["stop_reason"] = c.stop_reason
    return choice


def raise_if_failed(finish_reason: str | None) -> None:
    """A choice that ended in ``error`` (a failed model step or output processing) or
    ``abort`` is an API error."""
    if finish_reason == "error":
        raise internal("internal error while generating this request; it was stopped")
    if finish_reason == "abort":
        raise unavailable("the request was aborted by the server")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
