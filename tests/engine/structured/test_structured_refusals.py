"""Constraints the grammar backends would not enforce are refused, naming what is at fault:
JSON-schema keywords a backend drops (xgrammar serves them unconstrained, as the first
test shows), a contradictory ``allOf``, schemas nested past the limit, and grammars with a
rule that can never end."""

from __future__ import annotations

import pytest

from pagedserve import StructuredOutputsError, StructuredOutputsParams
from pagedserve.engine.structured import backend as backend_mod
from pagedserve.engine.structured.grammar_check import endless_rule
from pagedserve.engine.structured.manager import StructuredOutputManager
from pagedserve.engine.structured.params import MAX_SCHEMA_DEPTH

S = StructuredOutputsParams
OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# keyword named, schema, a text xgrammar's own grammar accepts that breaks the schema
UNENFORCED = [
    ("not", {"not": {"type": "integer"}}, "1"),
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}},
             "required": ["a"]}, '{"a": "x"}'),
    ("if/then/else", {**OBJ_AB, "if": {"properties": {"a": {"const": 1}}},
                      "then": {"required": ["b"]}}, '{"a": 1}'),
    ("dependentSchemas", {**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
     '{"a": 1}'),
    ("dependentRequired", {**OBJ_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ("dependencies", {**OBJ_AB, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "[1, 1]"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}},
     "[1]"),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                               "unevaluatedProperties": {"type": "string"}}, '{"a": 1}'),
]
XGRAMMAR_ONLY = [  # llguidance enforces these; xgrammar would not
    ("allOf", {"allOf": [{"type": "string"}, {"type": "integer"}]}, '"a"'),
    ("allOf", {"allOf": [{**OBJ_AB, "required": ["a"]}, {"required": ["b"]}]}, '{"a": 1}'),
    ("maxLength", {"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaa"'),
]


@pytest.fixture(scope="module")
def backends(default_tokenizer):
    tok = default_tokenizer
    return {name: backend_mod.load_backend(name, tok, 49152, (tok.eos_token_id,))
            for name in ("xgrammar", "llguidance")}


@pytest.fixture(scope="module")
def managers(default_tokenizer):
    tok = default_tokenizer
    mgrs = {name: StructuredOutputManager(name, tok, 49152, (tok.eos_token_id,))
            for name in ("auto", "xgrammar", "llguidance")}
    yield mgrs
    for m in mgrs.values():
        m.shutdown()


def _accepts(grammar, tokenizer, text: str) -> bool:
    m = grammar.matcher()
    return all(m.accept_token(t) for t in [*tokenizer.encode(text), tokenizer.eos_token_id])


@pytest.mark.parametrize("keyword, schema, breaking", UNENFORCED + XGRAMMAR_ONLY)
def test_xgrammar_alone_would_serve_text_that_breaks_the_keyword(
        backends, default_tokenizer, keyword, schema, breaking):
    grammar = backends["xgrammar"].compile(S(json=schema))
    assert _accepts(grammar, default_tokenizer, breaking)


def _refusal(mgr: StructuredOutputManager, spec: StructuredOutputsParams) -> str:
    with pytest.raises(StructuredOutputsError) as e:
        mgr.submit(spec).result(timeout=60)
    return str(e.value)


@pytest.mark.parametrize("keyword, schema, breaking", UNENFORCED)
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_keywords_no_backend_enforces_are_refused_by_name(
        managers, backend, keyword, schema, breaking):
    msg = _refusal(managers[backend], S(json=schema))
    assert msg.startswith(f"structured_outputs.json uses {keyword!r} at #"), msg
    assert "grammar backend does not enforce" in msg
    if keyword == "not" and "properties" in schema:
        assert " at #/properties/a," in msg


@pytest.mark.parametrize("keyword, schema, breaking", XGRAMMAR_ONLY)
def test_what_xgrammar_drops_is_refused_there_and_enforced_elsewhere(
        managers, default_tokenizer, keyword, schema, breaking):
    msg = _refusal(managers["xgrammar"], S(json=schema))
    assert msg.startswith(f"structured_outputs.json uses {keyword!r} at #, which the "
                          "xgrammar grammar backend does not enforce"), msg
    assert "structured_outputs_backend='llguidance' enforces it" in msg
    for name in ("auto", "llguidance"):
        try:
            grammar = managers[name].submit(S(json=schema)).result(timeout=60)
        except StructuredOutputsError as e:  # a contradiction: refused, not served
            assert "Unsatisfiable schema: incompatible types" in str(e), e
            assert schema["allOf"][0] == {"type": "string"}
            continue
        assert not _accepts(grammar, default_tokenizer, breaking)


def test_a_compatible_all_of_is_served_and_enforced_under_auto(managers, default_tokenizer):
    schema = {"allOf": [{**OBJ_AB, "required": ["a"]}, {"required": ["b"]}]}
    grammar = managers["auto"].submit(S(json=schema)).result(timeout=60)
    assert _accepts(grammar, default_tokenizer, '{"a": 1, "b": 2}')
    assert not _accepts(grammar, default_tokenizer, '{"a": 1}')


def test_keywords_that_are_no_constraint_are_served(managers):
    for schema in ({"type": "array", "uniqueItems": False},
                   {"type": "integer", "if": {"minimum": 3}},  # if alone asks nothing
                   {"allOf": [{"type": "integer"}]},
                   {"type": "string", "contentEncoding": "base64"}):
        for name, mgr in managers.items():
            if name == "llguidance" and ("uniqueItems" in schema or "if" in schema):
                continue  # llguidance refuses these keywords themselves
            mgr.submit(S(json=schema)).result(timeout=60)


def _nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def test_deep_schemas_are_refused_naming_the_limit_without_recursion_errors(managers):
    for depth in (MAX_SCHEMA_DEPTH, 5000):  # each level nests two JSON objects
        with pytest.raises(StructuredOutputsError,
                           match=f"structured_outputs.json nests deeper than "
                                 f"{MAX_SCHEMA_DEPTH} levels"):
            S(json=_nested(depth))
    deep_list: list = []
    for _ in range(5000):
        deep_list = [deep_list]
    with pytest.raises(StructuredOutputsError, match="nests deeper than"):
        S(json={"enum": [deep_list]})
    ok = _nested(MAX_SCHEMA_DEPTH // 2 - 1)
    managers["auto"].submit(S(json=ok)).result(timeout=120)


ENDLESS = [
    ('root ::= root "a"', "root"),
    ("root ::= a\na ::= a", "root"),
    ('root ::= "x" | b\nb ::= "y" b', "b"),  # root ends, but b, which it reaches, never does
    ('root ::= x{1,3}\nx ::= "(" x ")"', "root"),
    ('start: start "a"', "start"),  # Lark
    ('start: "a" [b]\nb: b "q"', "b"),
]
ENDING = [
    'root ::= "a" root | "b"',
    'root ::= "(" [a-c] [a-c]? [a-c]? ")"',
    'root ::= item+\nitem ::= [a-z] | "(" root ")"  # nested',
    'root ::= x{0,3}\nx ::= "y"',
    'root ::= "a" (= [b])',
    'start: item+\n?item: WORD | "(" start ")"\n%import common.WORD\n%ignore " "',
    'start: b ~ 2..3\nb: "x" -> bee',
    "root ::= " + "(" * 5000 + '"a"' + ")" * 5000,  # too deep to follow: left to the backend
]


@pytest.mark.parametrize("grammar, rule", ENDLESS)
def test_rules_that_never_end_are_found(grammar, rule):
    assert endless_rule(grammar) == rule


@pytest.mark.parametrize("grammar", ENDING)
def test_grammars_that_can_end_pass(grammar):
    assert endless_rule(grammar) is None


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_endless_grammars_are_refused_by_every_backend(managers, backend):
    for text, rule in ENDLESS:
        if backend == "xgrammar" and "::=" not in text:
            continue  # xgrammar reads GBNF only
        msg = _refusal(managers[backend], S(grammar=text))
        assert msg == (f"structured_outputs.grammar has no finite derivation: rule {rule!r} "
                       "never ends (each of its alternatives needs a rule that never ends, "
                       "such as itself)"), msg
    managers[backend].submit(S(grammar='root ::= "a" root | "b"')).result(timeout=60)


def test_a_cached_failure_is_each_callers_own_exception(managers):
    """A failed compile stays cached and every request with that constraint gets its
    error: as a copy each, so raising it (as each request does) cannot grow one shared
    traceback that keeps every earlier request's frames alive."""
    import pickle
    import traceback

    spec = S(json={"not": {}})
    first = managers["auto"].submit(spec).exception(timeout=60)
    for _ in range(20):
        with pytest.raises(StructuredOutputsError):
            managers["auto"].submit(spec).result()
    again = managers["auto"].submit(spec).exception(timeout=60)
    assert again is not first and str(again) == str(first) and again.kind == first.kind
    assert again.__traceback__ is None
    assert len(list(traceback.walk_tb(first.__traceback__))) == 0
    back = pickle.loads(pickle.dumps(again))  # as it crosses to a data-parallel front end
    assert (str(back), back.kind, back.field) == (str(again), again.kind, again.field)
