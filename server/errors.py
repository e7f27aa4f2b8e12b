"""API errors: ``{"error": {"message", "type", "param", "code"}}`` with HTTP status == code."""

from __future__ import annotations

import msgspec
from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the client should see; ``param`` names the offending request field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "APIError")

    def body(self) -> dict:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, param)


def unavailable(message: str, retry_after: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return APIError(503, message, None, headers)


def overloaded(message: str, retry_after: int = 1) -> APIError:
    return APIError(429, message, None, {"Retry-After": str(retry_after)})


def internal(message: str) -> APIError:
    return APIError(500, message, None)


def timed_out(message: str) -> APIError:
    return APIError(408, message, None)
