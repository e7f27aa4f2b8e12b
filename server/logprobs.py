"""Logprobs in the two OpenAI formats (chat ``content`` list, completions columns)."""

from __future__ import annotations

from collections.abc import Callable

from engine.outputs import TokenLogprobs

TokenText = Callable[[int], str]


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprobs], token_text: TokenText) -> list[dict]:
    """The ``logprobs.content`` items for the given sampled tokens."""
    content = []
    for e in entries:
        item = _entry(token_text(e.token_id), e.logprob)
        item["top_logprobs"] = [_entry(token_text(c.token_id), c.logprob) for c in e.top]
        content.append(item)
    return content


class CompletionLogprobs:
    """Builds ``{"tokens","token_logprobs","top_logprobs","text_offset"}`` for one choice.

    ``text_offset`` counts characters from the start of the choice's text (which
    includes the prompt when echoing); it carries over from one streamed chunk to the next.
    """

    def __init__(self, token_text: TokenText, start_offset: int = 0) -> None:
        self.token_text = token_text
        self.offset = start_offset

    def build(self, entries: list[TokenLogprobs]) -> dict:
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top: list[dict[str, float]] = []
        offsets: list[int] = []
        for e in entries:
            text = self.token_text(e.token_id)
            tokens.append(text)
            token_logprobs.append(e.logprob)
            cands = {self.token_text(c.token_id): c.logprob for c in e.top}
            cands.setdefault(text, e.logprob)
            top.append(cands)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict]) -> dict | None:
    """Concatenate the per-step column dicts of one choice."""
    if not parts:
        return None
    merged: dict[str, list] = {k: [] for k in parts[0]}
    for p in parts:
        for k, v in p.items():
            merged[k].extend(v)
    return merged
