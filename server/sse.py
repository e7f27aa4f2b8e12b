"""Server-sent events: every event is exactly ``data: <json>\\n\\n``; ``data: [DONE]`` ends."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from pagedserve.server.errors import APIError, bad_request, timed_out
from pagedserve.server.state import STATE_KEY

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def event(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + _encode(obj) + b"\n\n"


STREAM_KEY = web.RequestKey("stream", web.StreamResponse)
"""The request's open event stream (``request[STREAM_KEY]``), once the 200 is sent."""
STREAM_ERROR_KEY = web.RequestKey("stream_error", object)
"""A route's own frames for an error after the 200 (``err -> bytes``; the Responses
API's ``response.failed``); without it, :func:`send_error_and_done`'s."""


class _EventStream(web.StreamResponse):
    """A stream whose writes give up after ``write_timeout`` seconds: a client that stops
    reading looks like one that went away (``ConnectionResetError``), so its request is
    aborted, and the connection is closed (a write may have stopped mid-event)."""

    def __init__(self, request: web.Request, write_timeout: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.request = request
        self.write_timeout = write_timeout

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            async with asyncio.timeout(self.write_timeout):
                await super().write(data)
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            raise ConnectionResetError(
                f"the client took no data for {self.write_timeout:g}s") from None


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the 200 and the SSE headers."""
    resp = _EventStream(
        request, request.app[STATE_KEY].options.sse_write_timeout,
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                 "X-Accel-Buffering": "no"},
    )
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    request[STREAM_KEY] = resp
    return resp


async def send_error_and_done(resp: web.StreamResponse, err: APIError) -> None:
    """An error after the 200: an error event, then ``[DONE]`` (or the route's own
    frames, :data:`STREAM_ERROR_KEY`)."""
    request = getattr(resp, "request", None)
    frames = request.get(STREAM_ERROR_KEY) if request is not None else None
    await resp.write(frames(err) if frames is not None else event(err.body()) + DONE)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encode(obj), content_type="application/json")


async def read_json(request: web.Request) -> bytes:
    """The raw body of a POST; anything but ``application/json`` is a 400."""
    if request.content_type != "application/json":
        raise bad_request(
            f"Content-Type must be application/json, got {request.content_type!r}")
    opts = request.app[STATE_KEY].options
    try:
        async with asyncio.timeout(opts.body_timeout):
            return await request.read()
    except TimeoutError:
        raise timed_out(f"the request body did not arrive within {opts.body_timeout:g}s "
                        "(--body-timeout)") from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the request body is larger than {opts.max_body_bytes} bytes "
                            "(--max-body-mb)") from None
