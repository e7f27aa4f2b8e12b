"""Structured outputs and tools on the OpenAI routes: ``response_format``, vLLM's
``structured_outputs`` and ``guided_*`` extras, and ``tools`` with ``tool_choice``, as
one :class:`~engine.StructuredOutputsParams` and the name the client gave it.

A spec is compiled (in the engine's grammar pool, cached) before the request is
queued, so a schema or pattern the backend cannot compile is a 400 naming the
parameter, streamed or not.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pagedserve import StructuredOutputsError, StructuredOutputsParams
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import ChatCompletionRequest, _Sampling
from pagedserve.server.state import ServerState

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "any_whitespace")


@dataclass(slots=True)
class Constraint:
    spec: StructuredOutputsParams
    param: str
    """The request field it came from (named by a 400)."""
    names: dict[str, str]
    """Spec field -> how the client named it, for messages."""

    def error(self, exc: StructuredOutputsError):
        msg = str(exc)
        for kind, name in self.names.items():
            msg = msg.replace(f"structured_outputs.{kind}", name)
        return bad_request(msg, self.param)


def _make(param: str, names: dict[str, str], **kw: Any) -> Constraint:
    try:
        spec = StructuredOutputsParams(**kw)
    except StructuredOutputsError as e:
        raise Constraint(None, param, names).error(e) from None  # type: ignore[arg-type]
    return Constraint(spec, param, names)


def _from_response_format(req: ChatCompletionRequest) -> Constraint | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return _make("response_format", {"json_object": "response_format"}, json_object=True)
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise bad_request("response_format.json_schema.schema is required with type "
                              "'json_schema'", "response_format")
        return _make("response_format", {"json": "response_format.json_schema.schema"},
                     json=rf.json_schema.schema)
    raise bad_request(f"response_format type {rf.type!r} is not supported; use 'text', "
                      "'json_object' or 'json_schema'", "response_format")


def request_constraint(req: _Sampling) -> Constraint | None:
    """The one structured-output constraint a request sets (None if it sets none)."""
    found: list[Constraint] = []
    if isinstance(req, ChatCompletionRequest):
        c = _from_response_format(req)
        if c is not None:
            found.append(c)
    so = req.structured_outputs
    if so is not None:
        unknown = sorted(set(so) - set(SO_FIELDS))
        if unknown:
            raise bad_request(f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                              f"known: {', '.join(SO_FIELDS)}", "structured_outputs")
        found.append(_make("structured_outputs", {}, **so))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append(_make(name, {kind: name}, **{kind: value}))
    if len(found) > 1:
        raise bad_request("set at most one of response_format, structured_outputs and "
                          f"guided_*; got {', '.join(c.param for c in found)}", found[1].param)
    return found[0] if found else None


async def check_compiles(state: ServerState, c: Constraint) -> None:
    """A 400 naming the parameter unless the engine can serve ``c``."""
    eng = state.engine.engine
    if eng.config.speculative_config is not None:
        raise bad_request(f"{c.param} cannot be combined with speculative decoding, which "
                          "this server runs (speculative_config)", c.param)
    try:
        await asyncio.wrap_future(eng.structured.submit(c.spec))
    except StructuredOutputsError as e:
        raise c.error(e) from None
