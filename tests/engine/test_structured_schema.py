"""Schema rewrites for the grammar backends: bounded strings hold no raw control
characters (xgrammar), objects are closed to unnamed properties (llguidance), and both
backends accept and refuse the same JSON texts."""

from __future__ import annotations

import json

import pytest

from engine.structured import StructuredOutputsParams
from engine.structured import backend as backend_mod
from engine.structured.schema import (
    JSON_UNESCAPED_CHAR,
    bounded_strings_as_patterns,
    close_objects,
)

BOUNDED = {"type": "object", "properties": {
    "s": {"type": "string", "maxLength": 5},
    "t": {"type": "array", "items": {"type": "string", "minLength": 2}},
    "u": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]},
    "p": {"type": "string", "maxLength": 4, "pattern": "^[a-z]+$"},
}, "required": ["s"]}


def test_bounded_strings_become_patterns_over_unescaped_characters():
    out = bounded_strings_as_patterns(BOUNDED)
    props = out["properties"]
    assert props["s"] == {"type": "string", "pattern": f"^{JSON_UNESCAPED_CHAR}{{0,5}}$"}
    assert props["t"]["items"] == {"type": "string", "pattern": f"^{JSON_UNESCAPED_CHAR}{{2,}}$"}
    assert props["u"]["anyOf"][0]["pattern"] == f"^{JSON_UNESCAPED_CHAR}{{1,3}}$"
    assert props["p"] == BOUNDED["properties"]["p"]  # its own pattern wins: unchanged
    assert BOUNDED["properties"]["s"] == {"type": "string", "maxLength": 5}  # not modified
    bad = {"type": "string", "maxLength": -1}
    assert bounded_strings_as_patterns(bad) == bad  # left for the backend to refuse


def test_objects_without_a_word_on_other_properties_are_closed():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "m": {"type": "object", "additionalProperties": {"type": "integer"}},
        "c": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]}},
        "$defs": {"d": {"type": "object"}}}
    out = close_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["m"]["additionalProperties"] == {"type": "integer"}
    assert all("additionalProperties" not in s for s in out["properties"]["c"]["allOf"])
    assert out["$defs"]["d"] == {"type": "object", "additionalProperties": False}
    assert "additionalProperties" not in schema  # not modified


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, default_tokenizer):
    tok = default_tokenizer
    return backend_mod.load_backend(request.param, tok, 49152, (tok.eos_token_id,))


def _accepts(backend, tokenizer, schema, text) -> bool:
    m = backend.compile(StructuredOutputsParams(json=schema)).matcher()
    for t in tokenizer.encode(text):
        if not m.accept_token(t):
            return False
    return m.accept_token(tokenizer.eos_token_id)


@pytest.mark.parametrize("text, ok", [
    ('{"s": "abcde"}', True),
    ('{"s": "abcdef"}', False),
    ('{"s": "a\tb"}', False),  # a raw tab inside a JSON string: not JSON
    ('{"s": "a\x01"}', False),
    ('{"s": "a\nb"}', False),
    ('{"s": "ab", "t": ["xy", "日本"]}', True),
    ('{"s": "ab", "t": ["x"]}', False),
    ('{"s": "ab", "zz": 1}', False),  # a property the schema does not name
])
def test_both_backends_agree_on_bounded_strings_and_closed_objects(
        backend, default_tokenizer, text, ok):
    assert _accepts(backend, default_tokenizer, BOUNDED, text) is ok, text
    if ok:
        json.loads(text)
