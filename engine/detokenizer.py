"""Incremental detokenization with constant work per token.

The prefix_offset/read_offset technique (TGI, vLLM): decode only the tokens since the
last emission plus the few before them, and emit the new suffix once it no longer ends
with U+FFFD (an incomplete UTF-8 character split across byte-level BPE tokens).
"""

from __future__ import annotations

from typing import Any

from engine.stop import StopChecker

__all__ = ["IncrementalDetokenizer", "StopChecker"]

_PROMPT_CONTEXT = 5
"""Prompt tokens decoded before the first output token, so that tokenizers which strip a
leading space at the start of a decode (SentencePiece) keep the first token's space."""

_REPLACEMENT = "\ufffd"


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
        context = [t for t in prompt_token_ids if t not in self._skip][-_PROMPT_CONTEXT:]
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends mid-character: decoding from it would misalign
        self._ids: list[int] = context
        """Decode window source: prompt context, then output ids (skipped specials left out)."""
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""

    def _decode(self, ids: list[int]) -> str:
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
