"""The llguidance backend (``structured_outputs_backend="llguidance"``).

A compile builds the llguidance grammar and one template matcher, which validates it;
each request's matcher is a copy of the template (cheap, no grammar construction on the
engine thread). JSON grammars get the same fixed separators as the xgrammar backend
(``{"a": 1, "b": [1, 2]}``) unless ``any_whitespace``, and the same closed objects
(:func:`pagedserve.engine.structured.schema.close_objects`); GBNF grammars are converted to
llguidance's Lark syntax.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark

from pagedserve.engine.errors import CompileFailure
from pagedserve.engine.structured.backend import compile_error
from pagedserve.engine.structured.params import StructuredOutputsParams
from pagedserve.engine.structured.schema import close_objects

_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SOURCE_EXCERPT = re.compile(r"\n\s*\d+ \|.*", re.S)
"""llguidance appends the offending grammar line and a caret: not part of the message."""


class _Matcher:
    __slots__ = ("_m", "_eos", "_ended")

    def __init__(self, m: llg.LLMatcher, eos: frozenset[int]) -> None:
        self._m = m
        self._eos = eos
        self._ended = False

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        # What llguidance.torch.fill_next_token_bitmask does, without importing that
        # module (it sets up torch.compile at import).
        v = bitmask[row]
        if not v.is_contiguous() or v.dtype != torch.int32 or not v.is_cpu:
            raise ValueError("the bitmask row must be contiguous int32 on the CPU")
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept_token(self, token_id: int) -> bool:
        ok = self._m.consume_token(token_id)
        self._ended = ok and token_id in self._eos
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            self._ended = False

    def is_terminated(self) -> bool:
        return self._ended and self._m.is_stopped()


class _Grammar:
    __slots__ = ("_template", "_eos")

    def __init__(self, template: llg.LLMatcher, eos: frozenset[int]) -> None:
        self._template = template
        self._eos = eos

    def matcher(self) -> _Matcher:
        return _Matcher(self._template.deep_copy(), self._eos)


class Backend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        # n_vocab is the model's: rows padded past the tokenizer's tokens are masked.
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._eos = frozenset(eos_token_ids)

    def compile(self, constraint: StructuredOutputsParams) -> _Grammar:
        try:
            m = llg.LLMatcher(self._tokenizer, _grammar_text(constraint), log_level=0)
            if m.is_error():
                raise CompileFailure(_SOURCE_EXCERPT.sub("", m.get_error()))
        except Exception as e:  # the backend's parse and conversion errors
            raise compile_error(constraint, e) from None
        return _Grammar(m, self._eos)


def _grammar_text(constraint: StructuredOutputsParams) -> str:
    M = llg.LLMatcher
    kind = constraint.kind
    if kind in ("json", "json_object"):
        # Closed objects, as the xgrammar backend makes them; json_object is any object.
        schema = (json.dumps(close_objects(json.loads(constraint.json)), ensure_ascii=False)
                  if kind == "json" else '{"type":"object"}')
        return M.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": True} if constraint.any_whitespace else _COMPACT)
    if kind == "regex":
        return M.grammar_from_regex(constraint.regex)
    if kind == "choice":
        return M.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice))
    return M.grammar_from_lark(any_to_lark(constraint.grammar))
