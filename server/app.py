"""The aiohttp application: routes, API-key check, JSON errors for every failure."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from pagedserve.server import info, playground
from pagedserve.server.chat import chat_completions
from pagedserve.server.completions import completions
from pagedserve.server.cors import Cors
from pagedserve.server.embeddings import embeddings
from pagedserve.server.errors import APIError, timed_out
from pagedserve.server.openapi import openapi
from pagedserve.server.responses import responses
from pagedserve.server.score import rerank, score
from pagedserve.server.sse import STREAM_KEY, send_error_and_done
from pagedserve.server.state import STATE_KEY, ServerState
from pagedserve.server.stored_responses import delete_response, list_input_items, retrieve_response

logger = logging.getLogger("pagedserve.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health"}) | playground.OPEN_PATHS
"""Routes that need no API key (the health check and the page's static files)."""
SCORE_PATHS = ("/v1/score", "/score")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                              "/v1/embeddings", *SCORE_PATHS, *RERANK_PATHS})
_KEPT_HEADERS = ("Allow", "Retry-After")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into ``{"error": {...}}`` with HTTP status == code."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # Keep what the client needs to retry correctly (``Allow`` of a 405).
        headers = {k: v for k, v in e.headers.items() if k in _KEPT_HEADERS}
        return APIError(e.status, e.reason or str(e), headers=headers).response()
    except ConnectionResetError:
        raise
    except Exception:
        logger.exception("internal error handling %s %s", request.method, request.path)
        return APIError(500, "internal server error").response()


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With an API key configured, every route but ``/health`` needs ``Bearer KEY``."""
    key = request.app[STATE_KEY].options.api_key
    if key and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        # Header bytes that are not UTF-8 arrive as surrogate escapes: compared as the
        # bytes they were (never equal to the key), not a failure to encode.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("utf-8", "surrogateescape"), key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)")
    return await handler(request)


@web.middleware
async def inflight_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count generation requests, so a graceful shutdown can wait for them, and hold each
    to its deadline (``request_timeout``): past it, the handler is cancelled (leaving its
    ``Generation`` aborts the engine requests and frees their blocks) and the client gets
    a 408, as an error event when the stream had started."""
    if request.path not in GENERATION_PATHS:
        return await handler(request)
    state = request.app[STATE_KEY]
    limit = state.options.request_timeout
    state.enter()
    try:
        async with asyncio.timeout(limit) as deadline:
            return await handler(request)
    except TimeoutError:
        if not deadline.expired():
            raise
        err = timed_out(f"the request did not finish within {limit:g}s (--request-timeout); "
                        "it was aborted")
        stream = request.get(STREAM_KEY)
        if stream is None:
            return err.response()
        with contextlib.suppress(ConnectionResetError):
            await send_error_and_done(stream, err)
        return stream
    finally:
        state.leave()


def build_app(state: ServerState) -> web.Application:
    origins = state.options.allowed_origins
    cors = Cors(origins) if origins else None
    app = web.Application(
        middlewares=[*([cors.middleware] if cors else []), error_middleware, auth_middleware,
                     inflight_middleware],
        client_max_size=state.options.max_body_bytes)
    if cors is not None:
        app.on_response_prepare.append(cors.on_response_prepare)
    app[STATE_KEY] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/embeddings", embeddings)
    for path in SCORE_PATHS:
        app.router.add_post(path, score)
    for path in RERANK_PATHS:
        app.router.add_post(path, rerank)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/models", info.models)
    app.router.add_get("/v1/models/{model:.+}", info.model)  # served names may hold "/"
    app.router.add_get("/health", info.health)
    app.router.add_get("/metrics", info.metrics)
    app.router.add_get("/version", info.version)
    app.router.add_post("/tokenize", info.tokenize)
    app.router.add_post("/detokenize", info.detokenize)
    app.router.add_get("/openapi.json", openapi)
    if state.options.allow_runtime_lora_updating:
        app.router.add_post("/v1/load_lora_adapter", info.load_adapter)
        app.router.add_post("/v1/unload_lora_adapter", info.unload_adapter)
    playground.add_routes(app)
    return app
