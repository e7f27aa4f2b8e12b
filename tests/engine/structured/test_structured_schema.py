"""What the grammar backends make of a schema: bounded strings hold any JSON string
character, escapes included, and no raw control character (xgrammar's grammar is mended
for it); objects are closed to unnamed properties (llguidance's schema is rewritten for
it); both backends accept and refuse the same JSON texts."""

from __future__ import annotations

import json
import types

import pytest
import xgrammar as xgr

from pagedserve.engine.structured import StructuredOutputsParams
from pagedserve.engine.structured import backend as backend_mod
from pagedserve.engine.structured import xgrammar_backend as xb
from pagedserve.engine.structured.backend import choose_backend
from pagedserve.engine.structured.manager import StructuredOutputManager
from pagedserve.engine.structured.schema import close_objects, has_bounded_pattern

BOUNDED = {"type": "object", "properties": {
    "s": {"type": "string", "maxLength": 5},
    "t": {"type": "array", "items": {"type": "string", "minLength": 2}},
    "u": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]},
    "p": {"type": "string", "maxLength": 4, "pattern": "^[a-z]+$"},
}, "required": ["s"]}


def test_each_bounded_strings_character_rule_is_mended_in_xgrammars_grammar():
    printed = str(xgr.Grammar.from_json_schema(json.dumps(BOUNDED), any_whitespace=False))
    bodies = [line.partition(" ::= ")[2] for line in printed.splitlines()]
    # s, t's items and u's first member: three rules; p keeps its own pattern.
    assert bodies.count(xb._BOUNDED_STRING_CHAR) == 3, printed
    mended = xb.bounded_strings_with_escapes(printed)
    rules = dict(line.split(" ::= ", 1) for line in mended.splitlines())
    assert list(rules.values()).count("((json_string_char))") == 3
    assert rules["json_string_char"] == xb._JSON_STRING_CHAR
    assert xb._BOUNDED_STRING_CHAR not in rules.values()
    # A schema whose grammar already names the rule keeps its own.
    taken = printed.rstrip() + "\njson_string_char ::= ((\"x\"))"
    rules = dict(line.split(" ::= ", 1) for line in
                 xb.bounded_strings_with_escapes(taken).splitlines())
    assert rules["json_string_char"] == '(("x"))'
    assert rules["json_string_char_"] == xb._JSON_STRING_CHAR
    assert xb.bounded_strings_with_escapes(printed.replace(xb._BOUNDED_STRING_CHAR, "(([a]))")
                                           ) == printed.replace(xb._BOUNDED_STRING_CHAR,
                                                                "(([a]))")
    xgr.Grammar.from_ebnf(mended)  # parses (what it accepts: the test below)


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
    ('{"s": "a\\"b\\\\c"}', True),  # escaped quote and backslash: one character each
    ('{"s": "a\\nb\\t"}', True),
    ('{"s": "\\"\\"\\"\\"\\""}', True),  # five escaped quotes: five characters
    ('{"s": "\\"\\"\\"\\"\\"\\""}', False),
    ('{"s": "a\\qb"}', False),  # not an escape JSON has
    ('{"s": "ab", "t": ["xy", "日本"]}', True),
    ('{"s": "ab", "t": ["x"]}', False),
    ('{"s": "ab", "zz": 1}', False),  # a property the schema does not name
])
def test_both_backends_agree_on_bounded_strings_and_closed_objects(
        backend, default_tokenizer, text, ok):
    assert _accepts(backend, default_tokenizer, BOUNDED, text) is ok, text
    if ok:
        json.loads(text)


@pytest.mark.parametrize("text, xgrammar_ok, llguidance_ok", [
    ('{"s": "\\u0001"}', True, True),  # a control character, escaped as it must be
    ('{"s": "\\u00e9\\/"}', True, False),  # escapes llguidance keeps to their short form
    ('{"s": "\\ud83d\\ude00"}', False, False),  # one character written as two escapes
])
def test_unicode_escapes_in_bounded_strings(
        backend, default_tokenizer, text, xgrammar_ok, llguidance_ok):
    ok = xgrammar_ok if backend.name == "xgrammar" else llguidance_ok
    assert _accepts(backend, default_tokenizer, BOUNDED, text) is ok, text


S = StructuredOutputsParams
PATTERN_WITH_BOUNDS = {"type": "object", "properties": {
    "p": {"type": "string", "minLength": 2, "maxLength": 4, "pattern": "^[a-z]+$"}},
    "required": ["p"]}


def test_auto_gives_llguidance_the_bounds_xgrammar_would_drop(default_tokenizer):
    """And any bounded string: xgrammar's mended bounded string fills its mask a thousand
    times slower than llguidance's (about 0.15 s a row)."""
    assert has_bounded_pattern(BOUNDED) and has_bounded_pattern(PATTERN_WITH_BOUNDS)
    plain = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}
    unbounded = {"type": "object", "properties": {"s": {"type": "string"}}}
    assert not has_bounded_pattern(plain)
    assert choose_backend("auto", S(json=PATTERN_WITH_BOUNDS)) == "llguidance"
    assert choose_backend("auto", S(json=plain)) == "llguidance"
    assert choose_backend("auto", S(json=unbounded)) == "xgrammar"
    assert choose_backend("auto", S(regex="[a-z]{2,4}")) == "xgrammar"
    assert choose_backend("xgrammar", S(json=PATTERN_WITH_BOUNDS)) == "xgrammar"
    tok = default_tokenizer
    mgr = StructuredOutputManager("auto", tok, 49152, (tok.eos_token_id,))
    compiled = types.SimpleNamespace(compile=lambda spec: mgr.submit(spec).result())
    try:
        for text, ok in [('{"p": "abcd"}', True), ('{"p": "abcdefgh"}', False),
                         ('{"p": "a"}', False), ('{"p": "AB"}', False)]:
            assert _accepts(compiled, tok, PATTERN_WITH_BOUNDS, text) is ok, text
        assert _accepts(compiled, tok, plain, '{"s": "a\\"b"}')  # escapes
        assert _accepts(compiled, tok, unbounded, '{"s": "a"}')
        assert sorted(mgr._backends) == ["llguidance", "xgrammar"]
    finally:
        mgr.shutdown()
