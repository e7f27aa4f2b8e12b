"""``StructuredOutputsParams``: what a request's output must match, spelled as vLLM does.

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``,
``choice`` (a list of strings), ``grammar`` (EBNF, GBNF style) or ``json_object`` (any
JSON object). Validated on construction; a schema or pattern the backend cannot compile
is reported when it is compiled. Torch-free.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.errors import JSONTextError, StructuredOutputsError
from pagedserve.engine.jsonlimits import decode_json

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SCHEMA_DEPTH = 128
"""How deeply a JSON schema's objects and arrays may nest (a subschema takes about two
levels): the grammar backends build a schema's grammar recursively."""


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    """The grammar applies after the model's reasoning (``<think> ... </think>``).

    ``end``: the token ids of the end tag; the grammar applies from the token after
    them. ``started``: the prompt opened the reasoning. Otherwise the reasoning starts
    only if the first token is ``start`` (the start tag as one token id), which the
    first token may be beside what the grammar allows; any other first token is the
    grammar's. Tokens inside the reasoning are unconstrained.
    """

    end: tuple[int, ...]
    start: int | None = None
    started: bool = False

    def __post_init__(self) -> None:
        if (not isinstance(self.end, tuple) or not self.end
                or not all(isinstance(t, int) and t >= 0 for t in self.end)):
            raise StructuredOutputsError("structured_outputs.reasoning.end must be a "
                                         "non-empty tuple of token ids", "reasoning")
        if not self.started and not (isinstance(self.start, int) and self.start >= 0):
            raise StructuredOutputsError("structured_outputs.reasoning needs a start token "
                                         "id unless started is true", "reasoning")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    any_whitespace: bool = False
    """JSON grammars allow only fixed whitespace (``{"a": 1, "b": 2}``, no newlines or
    runs of spaces) unless this is true: small models tend to loop on free whitespace."""
    reasoning: ReasoningGate | None = None
    """Apply the grammar only after the model's reasoning (None: from the first token)."""

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}")
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningGate):
            raise StructuredOutputsError("structured_outputs.reasoning must be a "
                                         "ReasoningGate", "reasoning")
        if not isinstance(self.any_whitespace, bool):
            raise StructuredOutputsError("structured_outputs.any_whitespace must be true "
                                         "or false", "any_whitespace")
        kind = given[0]
        if kind == "json":
            object.__setattr__(self, "json", _schema_text(self.json))
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise StructuredOutputsError(
                    "structured_outputs.choice must be a non-empty list of non-empty "
                    "strings", "choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        elif kind == "json_object":
            if self.json_object is not True:
                raise StructuredOutputsError(
                    "structured_outputs.json_object must be true", "json_object")
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise StructuredOutputsError(
                f"structured_outputs.{kind} must be a non-empty string", kind)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, Any, bool]:
        """The compile cache key: equal constraints share one compiled grammar."""
        return self.kind, getattr(self, self.kind), self.any_whitespace


def _schema_text(schema: Any) -> str:
    """A JSON schema as compact JSON text (property order is kept: it decides the order
    of the output's properties)."""
    if isinstance(schema, str):
        try:
            schema = decode_json(schema, "structured_outputs.json")
        except JSONTextError as e:
            raise StructuredOutputsError(str(e), "json") from None
    if isinstance(schema, bool):
        schema = {} if schema else None
    if not isinstance(schema, dict):
        raise StructuredOutputsError(
            "structured_outputs.json must be a JSON schema object", "json")
    if _depth_over(schema, MAX_SCHEMA_DEPTH):
        raise StructuredOutputsError(
            f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels", "json")
    try:
        return _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise StructuredOutputsError(
            f"structured_outputs.json cannot be serialised: {e}", "json") from None


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value``'s dicts and lists nest deeper than ``limit`` (walked without
    recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return False
