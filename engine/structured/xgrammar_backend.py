"""The xgrammar backend (the default)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr

from pagedserve.engine.structured.backend import compile_error
from pagedserve.engine.structured.params import StructuredOutputsParams

# xgrammar (0.2.x) writes a string's minLength / maxLength as a repeat of one rule whose
# body is this class: raw control characters pass (not JSON) and no escape can be written.
_BOUNDED_STRING_CHAR = r'(([^\"\\\r\n]))'
# One character of a JSON string: as it is, or escaped. A \u escape names no surrogate,
# so each repeat is one character of the decoded string, as minLength / maxLength count.
_HEX = "[0-9a-fA-F]"
_JSON_STRING_CHAR = (
    r'(([^\"\\\0-\x1f]) | ("\\" [\"\\/bfnrt]) | ("\\u" '
    f'(([0-9a-cA-Ce-fE-F] {_HEX} {_HEX} {_HEX}) | ([dD] [0-7] {_HEX} {_HEX}))))')


def bounded_strings_with_escapes(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar) with each bounded string's character rule
    taking any JSON string character, escapes included, and no raw control character.
    The character is one rule that they all name (compiled once, not once a string)."""
    names = {line.partition(" ::= ")[0] for line in ebnf.splitlines()}
    char = "json_string_char"
    while char in names:
        char += "_"
    lines, mended = [], False
    for line in ebnf.splitlines():
        name, sep, body = line.partition(" ::= ")
        if body == _BOUNDED_STRING_CHAR:
            line, mended = f"{name}{sep}(({char}))", True
        lines.append(line)
    if not mended:
        return ebnf
    return "\n".join([*lines, f"{char} ::= {_JSON_STRING_CHAR}"])


class _Matcher:
    __slots__ = ("_m",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class _Grammar:
    __slots__ = ("compiled",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def matcher(self) -> _Matcher:
        return _Matcher(self.compiled)


class Backend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        # vocab_size is the model's: rows padded past the tokenizer's tokens are masked.
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, constraint: StructuredOutputsParams) -> _Grammar:
        c = self._compiler
        ws = constraint.any_whitespace
        try:
            kind = constraint.kind
            if kind == "json":
                g = c.compile_grammar(bounded_strings_with_escapes(str(
                    xgr.Grammar.from_json_schema(constraint.json, any_whitespace=ws))))
            elif kind == "json_object":
                g = c.compile_json_schema('{"type":"object"}', any_whitespace=ws,
                                          strict_mode=False)
            elif kind == "regex":
                g = c.compile_regex(constraint.regex)
            elif kind == "choice":
                alts = " | ".join(json.dumps(ch, ensure_ascii=False) for ch in constraint.choice)
                g = c.compile_grammar(f"root ::= {alts}")
            else:
                g = c.compile_grammar(constraint.grammar)
        except Exception as e:  # the backend's parse and conversion errors
            raise compile_error(constraint, e) from None
        return _Grammar(g)
