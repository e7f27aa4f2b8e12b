"""JSON-schema rewrites that make a backend's grammar say what the schema means.

- xgrammar (0.2.x) turns a string's ``minLength`` / ``maxLength`` into a character class
  that lets raw control characters through (a tab or a NUL inside a JSON string: not
  JSON). :func:`bounded_strings_as_patterns` states the same bounds as a pattern over
  the characters JSON allows unescaped.
- llguidance leaves objects open to properties the schema does not name; xgrammar's
  default (strict) does not. :func:`close_objects` gives llguidance the same outputs by
  making ``additionalProperties`` false where the schema leaves it unsaid.

Both return a new schema; the input is not modified. Torch-free.
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

JSON_UNESCAPED_CHAR = r'[^"\\\x00-\x1f]'
"""A character a JSON string may hold as it is (no quote, backslash or control char)."""

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


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _bounded_string(s: dict, _in_all_of: bool) -> dict:
    if s.get("type") != "string" or "pattern" in s or "format" in s:
        return s
    lo, hi = s.get("minLength", 0), s.get("maxLength")
    if ("minLength" not in s and hi is None) or not _is_count(lo) or (
            hi is not None and (not _is_count(hi) or hi < lo)):
        return s  # unbounded, or bounds the backend reports as invalid
    s = {k: v for k, v in s.items() if k not in ("minLength", "maxLength")}
    s["pattern"] = f"^{JSON_UNESCAPED_CHAR}{{{lo},{'' if hi is None else hi}}}$"
    return s


def bounded_strings_as_patterns(schema: dict) -> dict:
    """Strings with ``minLength`` / ``maxLength`` (and no ``pattern`` or ``format``) get
    the pattern ``^[^"\\\\\\x00-\\x1f]{min,max}$`` instead: the same lengths, no raw
    control characters (and, as before, no escapes)."""
    return map_subschemas(schema, _bounded_string)


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
