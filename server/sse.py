"""Server-sent events: every event is exactly ``data: <json>\\n\\n``; ``data: [DONE]`` ends."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from server.errors import APIError, bad_request

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def event(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + _encode(obj) + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the 200 and the SSE headers."""
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                 "X-Accel-Buffering": "no"},
    )
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    return resp


async def send_error_and_done(resp: web.StreamResponse, err: APIError) -> None:
    """An error after the 200: an error event, then ``[DONE]``."""
    await resp.write(event(err.body()) + DONE)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encode(obj), content_type="application/json")


async def read_json(request: web.Request) -> bytes:
    """The raw body of a POST; anything but ``application/json`` is a 400."""
    if request.content_type != "application/json":
        raise bad_request(
            f"Content-Type must be application/json, got {request.content_type!r}")
    return await request.read()
