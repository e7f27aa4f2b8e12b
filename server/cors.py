"""Cross-origin requests (CORS), so that a page served from another origin (a browser
chat UI) can call the API.

``--allowed-origins`` (default ``*``, as vLLM's): a browser's preflight (``OPTIONS`` with
``Access-Control-Request-Method``) is answered before the API-key check, which a
preflight never carries; every response to an allowed origin (JSON, errors, SSE streams)
carries ``Access-Control-Allow-Origin`` and exposes ``Retry-After``. No credentials
(cookies) are allowed: the API key travels in ``Authorization``. A preflight from an
origin not in the list is a 403; other requests from it get no CORS headers, so the
browser keeps their answers from the page.
"""

from __future__ import annotations

from aiohttp import web

from pagedserve.server.errors import APIError

ANY = "*"
ALLOW_METHODS = "GET, POST, OPTIONS"
MAX_AGE_S = 600
"""How long a browser may keep a preflight's answer."""


def parse_origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated origins (``scheme://host[:port]``), ``*``
    for any, empty for none (no CORS headers at all)."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in origins:
        if o != ANY and "://" not in o:
            raise ValueError(f"--allowed-origins: {o!r} is not an origin "
                             "(scheme://host[:port]) or *")
    return origins


class Cors:
    """The CORS policy of one app: :attr:`middleware` answers preflights (first, before
    the API-key check); :meth:`on_response_prepare` adds the headers to every other
    response before it is sent."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = ANY in origins
        self.origins = frozenset(origins)

        @web.middleware
        async def preflight(request: web.Request, handler) -> web.StreamResponse:
            return await self._preflight(request, handler)

        self.middleware = preflight

    def allow_origin(self, origin: str) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for ``origin``, or None."""
        if self.any:
            return ANY
        return origin if origin in self.origins else None

    async def _preflight(self, request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if (request.method != "OPTIONS" or origin is None
                or "Access-Control-Request-Method" not in request.headers):
            return await handler(request)
        allowed = self.allow_origin(origin)
        if allowed is None:
            return APIError(403, f"origin {origin!r} is not allowed "
                                 "(--allowed-origins)").response()
        headers = {
            "Access-Control-Allow-Origin": allowed,
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Max-Age": str(MAX_AGE_S),
        }
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            headers["Access-Control-Allow-Headers"] = asked
        if not self.any:
            headers["Vary"] = "Origin"
        return web.Response(status=204, headers=headers)

    async def on_response_prepare(self, request: web.Request,
                                  response: web.StreamResponse) -> None:  # fmt: skip
        origin = request.headers.get("Origin")
        allowed = None if origin is None else self.allow_origin(origin)
        if allowed is None or "Access-Control-Allow-Origin" in response.headers:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = "Retry-After"
        if not self.any:
            response.headers.add("Vary", "Origin")
