"""JSON-schema rewrites that make a backend's grammar say what the schema means.

llguidance leaves objects open to properties the schema does not name; xgrammar's
default (strict) does not. :func:`close_objects` gives llguidance the same outputs by
making ``additionalProperties`` false where the schema leaves it unsaid. (xgrammar's
bounded strings are mended in its grammar: ``xgrammar_backend.bounded_strings_with_escapes``.)
:func:`has_bounded_pattern` finds what xgrammar does not honour (the ``auto`` backend
gives such a schema to llguidance).

Rewrites return a new schema; the input is not modified. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "not", "if", "then",
                  "else", "contains", "propertyNames", "unevaluatedProperties",
                  "unevaluatedItems")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")

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


def has_bounded_pattern(schema: Any) -> bool:
    """Whether a string of ``schema`` has a ``pattern`` and ``minLength`` / ``maxLength``
    (xgrammar 0.2.x keeps the pattern and drops the bounds)."""
    found = []

    def look(s: dict, _in_all_of: bool) -> dict:
        if "pattern" in s and ("minLength" in s or "maxLength" in s):
            found.append(s)
        return s

    map_subschemas(schema, look)
    return bool(found)


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
