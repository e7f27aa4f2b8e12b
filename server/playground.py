"""The page at ``/`` (chat playground and live KV block map) and its state endpoint.

The page's files are static and ship in the package (``server/static``); they hold nothing
the API key protects, so they are served without it, and the page asks for the key
before it calls any API route. ``GET /v1/kv_cache/state`` is the block map's snapshot,
taken by the engine thread between steps (:meth:`engine.AsyncEngine.kv_state`).
"""

from __future__ import annotations

import asyncio
import base64
from importlib import resources

from aiohttp import web

from pagedserve.engine.core.kv_state import DEFAULT_MAX_CELLS, MAX_CELLS_LIMIT, KVState
from pagedserve.engine.errors import EngineDeadError
from pagedserve.server.errors import bad_request, unavailable
from pagedserve.server.sse import json_response
from pagedserve.server.state import STATE_KEY

STATE_PATH = "/v1/kv_cache/state"
SNAPSHOT_TIMEOUT_S = 30.0
CELL_ENCODING = "min(ref_count, 127) << 1 | prefix_cached"

_FILES = {
    "/": ("index.html", "text/html"),
    "/static/playground.js": ("playground.js", "text/javascript"),
    "/static/playground.css": ("playground.css", "text/css"),
}
OPEN_PATHS = frozenset(_FILES)
"""The page's own files: served without the API key."""


def _read(name: str) -> bytes:
    return resources.files("pagedserve.server").joinpath("static", name).read_bytes()


async def static_file(request: web.Request) -> web.Response:
    name, content_type = _FILES[request.path]
    return web.Response(body=_read(name), content_type=content_type, charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}", name) from None
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be between {lo} and {hi}, got {value}", name)
    return value


def _bool_param(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false", "1", "0"):
        raise bad_request(f"{name} must be true or false, got {raw!r}", name)
    return raw.lower() in ("true", "1")


def encode_state(st: KVState) -> dict:
    """The JSON body: the cells base64-encoded, each block table as ``[first, count]`` runs."""
    return {
        "object": "kv_cache.state", "time": st.time, "num_blocks": st.num_blocks,
        "block_size": st.block_size, "prefix_caching": st.prefix_caching,
        "blocks_per_cell": st.blocks_per_cell, "cell_encoding": CELL_ENCODING,
        "cells": base64.b64encode(st.cells).decode("ascii"),
        "loaded_cells": base64.b64encode(st.loaded_cells).decode("ascii"),
        "counters": st.counters,
        "requests": [{
            "id": r.request_id, "status": r.status, "num_tokens": r.num_tokens,
            "num_computed_tokens": r.num_computed_tokens,
            "num_cached_tokens": r.num_cached_tokens, "num_blocks": r.num_blocks,
            "block_table": r.block_runs} for r in st.requests],
    }  # fmt: skip


async def kv_cache_state(request: web.Request) -> web.Response:
    """``?max_cells=N`` (cells at most; a larger pool is summarized) and ``?tables=false``
    (leave the block tables out)."""
    max_cells = _int_param(request, "max_cells", DEFAULT_MAX_CELLS, 1, MAX_CELLS_LIMIT)
    tables = _bool_param(request, "tables", True)
    engine = request.app[STATE_KEY].engine
    try:
        st = await asyncio.wait_for(engine.kv_state(max_cells, tables), SNAPSHOT_TIMEOUT_S)
    except EngineDeadError as e:
        raise unavailable(str(e)) from None
    except asyncio.TimeoutError:
        raise unavailable("the engine thread did not answer in time", retry_after=1) from None
    return json_response(encode_state(st))


def add_routes(app: web.Application) -> None:
    for path in _FILES:
        app.router.add_get(path, static_file)
    app.router.add_get(STATE_PATH, kv_cache_state)
