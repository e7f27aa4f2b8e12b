"""JSON-schema rewrites that make a backend's grammar say what the schema means.

llguidance leaves objects open to properties the schema does not name; xgrammar's
default (strict) does not. :func:`close_objects` gives llguidance the same outputs by
making ``additionalProperties`` false where the schema leaves it unsaid. (xgrammar's
bounded strings are mended in its grammar: ``xgrammar_backend.bounded_strings_with_escapes``.)
:func:`has_bounded_pattern` finds what xgrammar does not honour (the ``auto`` backend
gives such a schema to llguidance). :func:`unenforced_keyword` finds a keyword no backend
enforces (or, with xgrammar, one it drops), so that the schema is refused rather than served
unconstrained.

Rewrites return a new schema; the input is not modified. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "not", "if", "then",
                  "else", "contains", "propertyNames", "unevaluatedProperties",
                  "unevaluatedItems")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_UNENFORCED = ("not", "dependentSchemas", "dependentRequired", "dependencies", "contains",
               "unevaluatedProperties", "unevaluatedItems")
"""Keywords that neither backend enforces (xgrammar drops them without a word)."""

Rewrite = Callable[[dict, bool], dict]


def map_subschemas(schema: Any, fn: Rewrite, in_all_of: bool = False) -> Any:
    """``schema`` with ``fn(subschema, in_all_of)`` applied to every subschema, innermost
    first; ``in_all_of`` says the subschema is a member of an ``allOf``."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            v = {name: map_subschemas(s, fn) for name, s in v.items()}
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            v = [map_subschemas(s, fn, k == "allOf") for s in v]
        elif k in _SCHEMA_VALUES:
            v = map_subschemas(v, fn)
        out[k] = v
    return fn(out, in_all_of)


def subschemas(schema: Any) -> Iterator[tuple[str, dict]]:
    """Every subschema of ``schema`` (itself included) with its JSON pointer, outermost
    first; iterative, so any depth is walked without recursion."""
    stack: list[tuple[str, Any]] = [("#", schema)]
    while stack:
        path, s = stack.pop()
        if not isinstance(s, dict):
            continue
        yield path, s
        found = []
        for k, v in s.items():
            if k in _SCHEMA_MAPS and isinstance(v, dict):
                found += [(f"{path}/{k}/{name}", sub) for name, sub in v.items()]
            elif k in _SCHEMA_LISTS and isinstance(v, list):
                found += [(f"{path}/{k}/{i}", sub) for i, sub in enumerate(v)]
            elif k in _SCHEMA_VALUES or k == "dependencies" and isinstance(v, dict):
                found += ([(f"{path}/{k}/{name}", sub) for name, sub in v.items()]
                          if k == "dependencies" else [(f"{path}/{k}", v)])
        stack.extend(reversed(found))


def _keyword(s: dict, backend: str) -> str | None:
    for k in _UNENFORCED:
        if k in s:
            return k
    if "if" in s and ("then" in s or "else" in s):
        return "if/then/else"
    if s.get("uniqueItems") is True:
        return "uniqueItems"
    if backend == "xgrammar":
        all_of = s.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return "allOf"
        if "pattern" in s and ("minLength" in s or "maxLength" in s):
            return "minLength" if "minLength" in s else "maxLength"
    return None


def unenforced_keyword(schema: Any, backend: str) -> tuple[str, str] | None:
    """The first keyword of ``schema`` that ``backend`` would not enforce, and the JSON
    pointer of the subschema that holds it; None if it enforces them all. No backend
    enforces ``not``, ``if``/``then``/``else``, ``dependentSchemas``,
    ``dependentRequired``, ``dependencies``, ``uniqueItems``, ``contains`` or
    ``unevaluated*``; xgrammar also drops an ``allOf`` of several members (it would
    take any one of them) and a string's length bounds beside its ``pattern``."""
    for path, s in subschemas(schema):
        k = _keyword(s, backend)
        if k is not None:
            return k, path
    return None


def prefers_llguidance(schema: Any) -> bool:
    """Whether llguidance serves ``schema`` better than xgrammar: a string with length
    bounds (xgrammar fills such a string's mask a thousand times slower, or drops the
    bounds beside a ``pattern``) or an ``allOf`` of several members (xgrammar does not
    enforce it; llguidance merges it and refuses a contradiction)."""
    for _path, s in subschemas(schema):
        if "minLength" in s or "maxLength" in s:
            return True
        all_of = s.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return True
    return False


def has_bounded_pattern(schema: Any) -> bool:
    """Whether a string of ``schema`` has a ``pattern`` and ``minLength`` / ``maxLength``
    (xgrammar 0.2.x keeps the pattern and drops the bounds)."""
    return any("pattern" in s and ("minLength" in s or "maxLength" in s)
               for _path, s in subschemas(schema))


def _closed_object(s: dict, in_all_of: bool) -> dict:
    if in_all_of or any(k in s for k in _OPEN_KEYS):
        return s  # an allOf member is closed by nothing: its siblings add properties
    if s.get("type") == "object" or "properties" in s:
        s = {**s, "additionalProperties": False}
    return s


def close_objects(schema: dict) -> dict:
    """Objects that do not say whether other properties may appear get
    ``additionalProperties: false``."""
    return map_subschemas(schema, _closed_object)
