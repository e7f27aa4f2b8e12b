"""Logprobs in the two OpenAI formats (chat ``content`` list, completions columns)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve import TokenLogprobs

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True, slots=True)
class TokenPiece:
    """One token as logprobs show it."""

    text: str
    """Its decoded text; for a token that holds only part of a UTF-8 character,
    ``bytes:`` and its bytes escaped (``bytes:\\xf0\\x9f``), so that two such tokens
    never share a name."""
    bytes: list[int]
    """Its UTF-8 bytes (for a piece of a character, that piece alone)."""
    width: int
    """Characters it adds to a plain decode (U+FFFD for a piece of a character)."""


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 byte values, inverted."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_piece(tokenizer: Any, text: str, token_id: int) -> TokenPiece:
    """``token_id``, whose text decoded alone is ``text``; its raw bytes when that text
    has a replacement character (byte-level BPE vocabularies, SentencePiece byte
    fallback ``<0xNN>``)."""
    if "\ufffd" not in text:
        return TokenPiece(text, list(text.encode("utf-8")), len(text))
    raw = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_decoder()
    if isinstance(raw, str) and (m := _BYTE_TOKEN.fullmatch(raw)):
        data = bytes([int(m.group(1), 16)])
    elif isinstance(raw, str) and raw and all(c in table for c in raw):
        data = bytes(table[c] for c in raw)
    else:
        return TokenPiece(text, list(text.encode("utf-8")), len(text))
    try:
        return TokenPiece(data.decode("utf-8"), list(data), len(text))
    except UnicodeDecodeError:
        shown = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        return TokenPiece(shown, list(data), len(text))


TokenPieces = Callable[[int], TokenPiece]


def _entry(piece: TokenPiece, logprob: float) -> dict:
    return {"token": piece.text, "logprob": logprob, "bytes": piece.bytes}


def chat_logprobs(entries: list[TokenLogprobs], pieces: TokenPieces) -> list[dict]:
    """The ``logprobs.content`` items for the given sampled tokens."""
    content = []
    for e in entries:
        item = _entry(pieces(e.token_id), e.logprob)
        item["top_logprobs"] = [_entry(pieces(c.token_id), c.logprob) for c in e.top]
        content.append(item)
    return content


class CompletionLogprobs:
    """Builds ``{"tokens","token_logprobs","top_logprobs","text_offset"}`` for one choice.

    ``text_offset`` is where each token's text begins in the choice's text (which
    includes the prompt when echoing), in characters: the engine's offset of the token in
    the output, after ``start_offset`` characters of echoed prompt. (Without one, the
    widths of the tokens decoded alone are summed, carried from one streamed chunk to
    the next.)
    """

    def __init__(self, pieces: TokenPieces, start_offset: int = 0) -> None:
        self.pieces = pieces
        self.start = self.offset = start_offset

    def build(self, entries: list[TokenLogprobs]) -> dict:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for e in entries:
            piece = self.pieces(e.token_id)
            tokens.append(piece.text)
            token_logprobs.append(e.logprob)
            cands = {self.pieces(c.token_id).text: c.logprob for c in e.top}
            cands.setdefault(piece.text, e.logprob)
            top.append(cands)
            offsets.append(self.offset if e.text_offset is None else self.start + e.text_offset)
            self.offset += piece.width
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def build_prompt(self, first_token: int, entries: list[TokenLogprobs]) -> dict:
        """The columns of an echoed prompt (``entries``: the engine's prompt logprobs
        after the first token, which has none: ``null`` in ``token_logprobs`` and
        ``top_logprobs``); offsets from the start of the prompt's text."""
        cols = CompletionLogprobs(self.pieces).build(entries)
        cols["tokens"].insert(0, self.pieces(first_token).text)
        cols["token_logprobs"].insert(0, None)
        cols["top_logprobs"].insert(0, None)
        cols["text_offset"].insert(0, 0)
        return cols


def prompt_logprobs_json(entries: list[TokenLogprobs | None]) -> list[dict | None]:
    """The engine's prompt logprobs as vLLM's ``prompt_logprobs``: per prompt token,
    ``null`` for the first, else ``{token id: {"logprob", "rank", "decoded_token"}}`` over
    the prompt token and its most likely candidates."""
    return [None if e is None else
            {str(tid): {"logprob": c.logprob, "rank": c.rank, "decoded_token": c.decoded}
             for tid, c in e.items()} for e in entries]  # fmt: skip


def merge_completion_logprobs(parts: list[dict]) -> dict | None:
    """Concatenate the per-step column dicts of one choice."""
    if not parts:
        return None
    merged: dict[str, list] = {k: [] for k in parts[0]}
    for p in parts:
        for k, v in p.items():
            merged[k].extend(v)
    return merged
