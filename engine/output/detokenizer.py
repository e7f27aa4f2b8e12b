"""Incremental detokenization with constant work per token.

The prefix_offset/read_offset technique (TGI, vLLM): decode only the tokens since the
last emission plus the few before them, and emit the new suffix once it no longer ends
with U+FFFD (an incomplete UTF-8 character split across byte-level BPE tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedserve.engine.output.stop import StopChecker

__all__ = ["IncrementalDetokenizer", "StopChecker"]

_PROMPT_CONTEXT = 5
"""Prompt tokens decoded before the first output token, so that tokenizers which strip a
leading space at the start of a decode (SentencePiece) keep the first token's space."""

_REPLACEMENT = "\ufffd"


def backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own ``decode`` where it returns what ``tokenizer.decode`` would:
    a fast tokenizer whose class keeps transformers' ``decode`` and ``_decode`` and whose
    clean-up of tokenization spaces is off (the wrapper then passes the backend's text
    through unchanged, after converting its arguments: a few microseconds a call, two calls
    a token, every running request, every step). None otherwise."""
    import transformers

    base = getattr(transformers, "PreTrainedTokenizerFast", None)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (base is None or backend is None or not isinstance(tokenizer, base)
            or type(tokenizer).decode is not base.decode
            or type(tokenizer)._decode is not base._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    decode = backend.decode

    def run(ids: list[int]) -> str:
        return decode(ids, skip_special_tokens=skip_special_tokens)

    return run


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if not getattr(tokenizer, "is_fast", True):
            # Only slow (pure Python) tokenizers implement this switch.
            self._kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
        special: set[int] = set(getattr(tokenizer, "all_special_ids", ()) or ())
        for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                special.add(tid)
        self._skip: frozenset[int] = frozenset(special) if skip_special_tokens else frozenset()
        self._fast = backend_decode(tokenizer, skip_special_tokens)
        context = [t for t in prompt_token_ids if t not in self._skip][-_PROMPT_CONTEXT:]
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends mid-character: decoding from it would misalign
        self._ids: list[int] = context
        """Decode window source: prompt context, then output ids (skipped specials left out)."""
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids)
        return self._tok.decode(ids, **self._kwargs)

    def decode_next(self, token_id: int) -> str:
        """Add one output token; return the text it completes ("" while a character is
        incomplete or for a skipped special token)."""
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop tokens that can never be part of a window again.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of the output, release text held back for an incomplete character
        (decoded with U+FFFD, as a full decode would)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text += delta
        return delta

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        return self._text
