"""The OpenAPI 3.1 document served at ``/openapi.json``, generated from the msgspec
request structs (so it always describes what the server decodes)."""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from aiohttp import web

from pagedserve import __version__
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
)

_REF = "#/components/schemas/{name}"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": "integer"},
        },
    }},
}
_ERROR_CODES = {
    "400": "invalid parameter or malformed body",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "408": "the body or the request took too long",
    "413": "the body is over the size limit",
    "429": "too many sequences waiting",
    "503": "shutting down or the engine is not running",
}
_ANY_JSON = {"application/json": {"schema": {"type": "object"}}}
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
"""One server-sent event (OpenAPI 3.1 has a stream's schema describe each event)."""


def _errors() -> dict[str, Any]:
    return {code: {"description": text, "content": {"application/json": {
        "schema": {"$ref": _REF.format(name="Error")}}}} for code, text in _ERROR_CODES.items()}


def _post(schema: str, summary: str, stream: bool = False) -> dict[str, Any]:
    ok: dict[str, Any] = dict(_ANY_JSON)
    if stream:
        ok["text/event-stream"] = {"schema": _EVENT}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(name=schema)}}}},
        "responses": {"200": {"description": "success", "content": ok}, **_errors()},
    }}


def _get(summary: str, content_type: str = "application/json",
         codes: tuple[str, ...] = ("401",)) -> dict[str, Any]:
    ok = {"description": "success"}
    if content_type:
        ok["content"] = {content_type: {"schema": {"type": "object" if content_type ==
                                                   "application/json" else "string"}}}
    errs = _errors()
    return {"get": {"summary": summary,
                    "responses": {"200": ok, **{c: errs[c] for c in codes}}}}


def _stored_response() -> dict[str, Any]:
    """``GET`` and ``DELETE /v1/responses/{response_id}``."""
    param = [{"name": "response_id", "in": "path", "required": True,
              "schema": {"type": "string"}}]
    get = _get("a stored response", codes=("401", "404"))["get"]
    return {"get": {**get, "parameters": param},
            "delete": {**get, "summary": "delete a stored response", "parameters": param}}


def build_document() -> dict[str, Any]:
    """The OpenAPI document of every route."""
    _, components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ResponsesRequest, EmbeddingRequest,
         ScoreRequest, RerankRequest, TokenizeRequest, DetokenizeRequest],
        ref_template=_REF)
    components["Error"] = _ERROR
    health = _get("200 while the engine is alive and progressing, else 503", "",
                  codes=("503",))
    health["get"]["security"] = []  # the one route open without the API key
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": __version__},
        "paths": {
            "/v1/chat/completions": _post("ChatCompletionRequest", "chat completion", True),
            "/v1/completions": _post("CompletionRequest", "text completion", True),
            "/v1/responses": _post("ResponsesRequest", "a response (Responses API)", True),
            "/v1/responses/{response_id}": _stored_response(),
            "/v1/responses/{response_id}/input_items": {"get": {
                **_get("a stored response's input items", codes=("400", "401", "404"))["get"],
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True,
                     "schema": {"type": "string"}},
                    *({"name": k, "in": "query", "required": False,
                       "schema": {"type": t}} for k, t in (
                        ("limit", "integer"), ("order", "string"), ("after", "string"),
                        ("before", "string")))]}},
            "/v1/embeddings": _post("EmbeddingRequest", "embeddings of the inputs"),
            "/v1/score": _post("ScoreRequest", "cosine similarity of text_1 and text_2"),
            "/v1/rerank": _post("RerankRequest", "documents by relevance to a query"),
            "/tokenize": _post("TokenizeRequest", "prompt or messages to token ids"),
            "/detokenize": _post("DetokenizeRequest", "token ids to text"),
            "/v1/models": _get("served models"),
            "/v1/models/{model}": {"get": {
                **_get("one served model", codes=("401", "404"))["get"],
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}]}},
            "/version": _get("server version"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/health": health,
            "/openapi.json": _get("this document"),
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


@functools.cache
def _document_bytes() -> bytes:
    return msgspec.json.encode(build_document())


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=_document_bytes(), content_type="application/json")
