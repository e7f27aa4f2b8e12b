"""What every handler shares: the async engine, the tokenizer, names, limits, metrics."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from pagedserve import AsyncEngine, EngineInputError, LoRARequest, SamplingParams
from pagedserve.server.errors import bad_request, not_found, overloaded, unavailable
from pagedserve.server.logprobs import TokenPiece, TokenPieces, token_piece
from pagedserve.server.lora import LoRAAdapters
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.options import ServeOptions
from pagedserve.server.param_names import Route, input_error
from pagedserve.server.responses_store import ResponseStore

T = TypeVar("T")


class ServerState:
    def __init__(self, engine: AsyncEngine, options: ServeOptions) -> None:
        self.engine = engine
        info = engine.info
        self.info = info
        self.tokenizer = info.tokenizer
        self.options = options
        self.model_names = options.served_model_names or (info.model_name,)
        self.loras = LoRAAdapters(options.lora_modules, self.model_names, info.lora)
        self.responses = ResponseStore(options.max_stored_responses)
        """Stored ``/v1/responses`` responses (``previous_response_id``)."""
        """The LoRA adapters served by name (``--lora-modules``)."""
        self.max_model_len = info.max_model_len
        self.sampling_defaults: dict = (dict(info.generation_defaults)
                                        if options.generation_config == "auto" else {})
        """What a request's unset sampling fields default to (the model's
        ``generation_config.json`` under ``--generation-config auto``)."""
        self.created = int(time.time())
        replicas = (lambda: self.engine.replica_snapshots) \
            if hasattr(engine, "replica_snapshots") else None  # fmt: skip
        self.metrics = ServerMetrics(self.model_names[0], lambda: self.engine.snapshot,
                                     replicas)  # fmt: skip
        self.shutting_down = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        tok = self.tokenizer
        self._token_piece = functools.lru_cache(maxsize=65536)(
            lambda t: token_piece(tok, tok.decode([t], skip_special_tokens=False), t))

    # -- naming -------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The served name to answer with (the base model's or an adapter's); an unknown
        model is a 404 naming ``model``."""
        if model is None or model == "":
            return self.model_names[0]
        if model not in self.model_names and self.loras.get(model) is None:
            raise not_found(f"The model `{model}` does not exist.", "model")
        return model

    def resolve_model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """:meth:`check_model`'s name, and the adapter it serves (None: the base model)."""
        name = self.check_model(model)
        return name, self.loras.get(name)

    # -- admission ----------------------------------------------------------------------
    def admit(self, num_seqs: int = 1) -> None:
        """Raise 503 when shutting down or the engine is unhealthy (dead or stalled), 429
        when ``num_seqs`` more sequences would pass the waiting limit, 400 when they
        alone would."""
        if self.shutting_down:
            raise unavailable("the server is shutting down", retry_after=5)
        if not self.engine.is_alive:
            raise unavailable("the engine is not running")
        if not self.engine.is_healthy:
            raise unavailable("the engine is not making progress; retry later", retry_after=5)
        limit = self.options.max_waiting_requests
        if limit is None:
            return
        if num_seqs > limit:
            raise bad_request(
                f"the request makes {num_seqs} sequences (prompts x n); at most {limit} may "
                "wait at once (--max-waiting-requests)", "n")
        if self.engine.num_waiting_estimate() + num_seqs > limit:
            raise overloaded(
                f"too many sequences waiting ({limit} allowed); retry later", retry_after=1)

    def check_request_limits(self, params: SamplingParams) -> None:
        """The server's caps on stop strings and ``logit_bias`` (work per step and per
        token grows with them)."""
        opts = self.options
        for s in params.stop or ():
            if len(s) > opts.max_stop_length:
                raise bad_request(
                    f"stop strings may have at most {opts.max_stop_length} characters, got "
                    f"one of {len(s)}", "stop")
        if params.logit_bias and len(params.logit_bias) > opts.max_logit_bias:
            raise bad_request(
                f"logit_bias may have at most {opts.max_logit_bias} entries, got "
                f"{len(params.logit_bias)}", "logit_bias")

    def fit(self, num_prompt_tokens: int, params: SamplingParams, route: Route) -> None:
        """Check the lengths and token ids before answering (the engine's own checks, which
        it repeats at admission), so that a bad request is a 400 before any stream opens."""
        try:
            self.info.limits.resolve_max_tokens(num_prompt_tokens, params)
        except EngineInputError as e:
            raise input_error(e, route) from None

    def check_sampling_token_ids(self, params: SamplingParams, route: Route) -> None:
        """``logit_bias`` keys and ``stop_token_ids`` inside the vocabulary, and the
        server's caps on stop strings and ``logit_bias``."""
        self.check_request_limits(params)
        try:
            self.info.limits.check_sampling_token_ids(params)
        except EngineInputError as e:
            raise input_error(e, route) from None

    def check_token_ids(self, ids: list[int], route: Route) -> None:
        """Token ids inside the vocabulary; else a 400 naming ``route``'s prompt field."""
        try:
            self.info.limits.check_token_ids(ids)
        except EngineInputError as e:
            raise input_error(e, route) from None

    # -- tokenizer ------------------------------------------------------------------------
    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the tokenizer thread. Every piece of request preparation whose
        cost grows with the input (templates, tokenization, type and range walks over
        token ids, decoding) goes through here, so the loop's latency never depends on
        what a client sends."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def token_piece(self, token_id: int) -> TokenPiece:
        """One token as logprobs show it (cached)."""
        return self._token_piece(token_id)

    def pieces(self, as_token_ids: bool | None) -> TokenPieces:
        """How a request's logprobs name tokens: by their text, or as ``token_id:N``
        (vLLM's ``return_tokens_as_token_ids``: tokens no JSON string can carry whole)."""
        return self._id_piece if as_token_ids else self.token_piece

    def _id_piece(self, token_id: int) -> TokenPiece:
        name = f"token_id:{token_id}"
        return TokenPiece(name, list(name.encode()), self._token_piece(token_id).width)

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
