"""What every handler shares: the async engine, the tokenizer, names, limits, metrics."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.llm_engine import PromptTooLongError
from engine.sampler import check_token_ids
from engine.sampling_params import SamplingParamError, SamplingParams
from server.errors import bad_request, not_found, overloaded, unavailable
from server.logprobs import TokenPiece, token_piece
from server.metrics import ServerMetrics

T = TypeVar("T")

INLINE_TOKENIZE_CHARS = 4096
"""Texts longer than this are tokenized in a worker thread, keeping the loop responsive."""


@dataclass(frozen=True)
class ServeOptions:
    """Server options that are not engine configuration."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_waiting_requests: int | None = None
    shutdown_timeout: float = 30.0


class ServerState:
    def __init__(self, engine: AsyncEngine, options: ServeOptions) -> None:
        self.engine = engine
        llm = engine.engine
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.options = options
        default_name = llm.worker.model_name
        self.model_names = options.served_model_names or (default_name,)
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.vocab_size
        self.kv_capacity_tokens = llm.kv.num_blocks * llm.block_size
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model_names[0], lambda: self.engine.snapshot)
        self.shutting_down = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._token_piece = functools.lru_cache(maxsize=65536)(
            lambda t: token_piece(self.tokenizer, llm.token_text(t), t))

    # -- naming -------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The served name to answer with; an unknown model is a 404 naming ``model``."""
        if model is None or model == "":
            return self.model_names[0]
        if model not in self.model_names:
            raise not_found(f"The model `{model}` does not exist.", "model")
        return model

    # -- admission ----------------------------------------------------------------------
    def admit(self) -> None:
        """Raise 503 when shutting down or the engine is dead, 429 when the queue is full."""
        if self.shutting_down:
            raise unavailable("the server is shutting down", retry_after=5)
        if not self.engine.is_alive:
            raise unavailable("the engine is not running")
        limit = self.options.max_waiting_requests
        if limit is not None and self.engine.num_waiting_estimate() >= limit:
            raise overloaded(
                f"too many requests waiting ({limit} allowed); retry later", retry_after=1)

    def fit(self, num_prompt_tokens: int, params: SamplingParams, prompt_param: str,
            limit_param: str, fill_context: bool = False) -> SamplingParams:
        """Validate the lengths (the engine's ``check_length``) and resolve the token limit.

        With ``fill_context`` and no limit, the limit is the room left in the context,
        capped by what the whole KV cache can hold.
        """
        if params.max_tokens is None and fill_context:
            room = min(self.max_model_len, self.kv_capacity_tokens) - num_prompt_tokens
            if room >= 1:
                params.max_tokens = room
        try:
            self.llm.check_length(num_prompt_tokens, params, prompt_param)
        except PromptTooLongError as e:
            param = limit_param if e.param == "max_tokens" else e.param
            raise bad_request(str(e), param) from None
        if params.max_tokens is not None and params.min_tokens > params.max_tokens:
            raise bad_request(
                f"min_tokens={params.min_tokens} is larger than the token limit "
                f"{params.max_tokens}", "min_tokens")
        return params

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} is out of range [0, {vocab})", param)

    def check_sampling_token_ids(self, params: SamplingParams) -> None:
        try:
            check_token_ids(params, self.vocab_size)
        except SamplingParamError as e:
            raise bad_request(str(e), e.param) from None

    # -- tokenizer ------------------------------------------------------------------------
    async def run_tokenizer(self, size: int, fn: Callable[..., T], *args: Any,
                            **kwargs: Any) -> T:
        """Run ``fn`` inline for small inputs, on the tokenizer thread for large ones."""
        if size <= INLINE_TOKENIZE_CHARS:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def token_piece(self, token_id: int) -> TokenPiece:
        """One token as logprobs show it (cached)."""
        return self._token_piece(token_id)

    # -- in-flight accounting (graceful shutdown) ----------------------------------------
    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


STATE_KEY = web.AppKey("state", ServerState)
