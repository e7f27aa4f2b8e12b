"""Reasoning split from the answer on chat completions (``--reasoning-parser``).

Reasoning models (Qwen3, QwQ, DeepSeek-R1 and its distills) think between ``<think>``
and ``</think>`` before they answer. With a parser the thinking goes to the message's
``reasoning_content`` (and ``reasoning``, the newer spelling), the rest to ``content``
(and on to the tool-call parser); streamed, to ``delta.reasoning_content`` and
``delta.content``.

Where the output starts is read from the prompt: a chat template that ends the prompt
with ``<think>`` (DeepSeek-R1, Qwen3's thinking-only models) starts the output inside
the reasoning; otherwise the output is reasoning only if it begins with
``<think>`` (Qwen3 with thinking on). Qwen3 with ``enable_thinking: false`` writes an
empty ``<think></think>`` into the prompt, and its output is all content. An output that
ends before ``</think>`` (its token limit) is all reasoning. Whitespace that touches a
tag is dropped. Fed in pieces or whole, the parser gives the same split.

Structured outputs (``response_format``, ``structured_outputs``, the grammars of
``tool_choice``) apply after the reasoning, as :func:`grammar_gate` tells the engine.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagedserve.engine.structured.params import ReasoningGate
from pagedserve.server.tool_parser import held

PARSERS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}
"""Parser name -> (start tag, end tag)."""

_START, _REASONING, _CONTENT = range(3)


def opens_reasoning(prompt_text: str | None, start: str) -> bool:
    """The prompt ends by opening the reasoning (its generation prompt ends with the
    start tag); a tag elsewhere in the prompt, in a message's text, does not count."""
    return (prompt_text or "").rstrip().endswith(start)


def grammar_gate(tokenizer: Any, name: str, prompt_text: str | None) -> ReasoningGate | None:
    """How a request's structured output waits for the reasoning to end: from the
    prompt's open tag, or from a start tag the model may generate first (when the tag is
    one token). None: the tag is several tokens and the prompt opens nothing, so the
    grammar applies from the first token (and leaves no room for reasoning)."""
    start, end = PARSERS[name]
    end_ids = tuple(tokenizer.encode(end, add_special_tokens=False))
    if opens_reasoning(prompt_text, start):
        return ReasoningGate(end_ids, started=True)
    start_ids = tokenizer.encode(start, add_special_tokens=False)
    return ReasoningGate(end_ids, start=start_ids[0]) if len(start_ids) == 1 else None


def gate_after_reasoning(params: Any, tokenizer: Any, name: str | None,
                         prompt_text: str | None) -> None:
    """With a reasoning parser ``name``, ``params``' structured output (if any) applies
    after the reasoning."""
    if params.structured_outputs is not None and name is not None:
        params.structured_outputs = replace(
            params.structured_outputs, reasoning=grammar_gate(tokenizer, name, prompt_text))


class ReasoningParser:
    """Feed text with :meth:`feed`, then :meth:`finish`; each returns the new
    ``(reasoning, content)`` pieces."""

    def __init__(self, name: str, prompt_text: str | None) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}")
        self.start, self.end = PARSERS[name]
        self._default = _REASONING if opens_reasoning(prompt_text, self.start) else _CONTENT
        self._phase = _START
        self._buf = ""
        self._lead = True
        """Whitespace at the start of the current part is dropped."""

    @property
    def in_reasoning(self) -> bool:
        """The text fed last ended inside the reasoning (or may still open it)."""
        return self._phase == _REASONING or (self._phase == _START
                                               and self._default == _REASONING)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buf += text
        if self._phase == _START and not self._decide(final):
            return "", ""
        reasoning = self._reasoning(final) if self._phase == _REASONING else ""
        content = ""
        if self._phase == _CONTENT:
            if self._lead:
                self._buf = self._buf.lstrip()
                self._lead = not self._buf
            content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)

    def _decide(self, final: bool) -> bool:
        """At the output's start: an opening tag starts the reasoning; text that may
        still become one is held; anything else is the default part."""
        s = self._buf.lstrip()
        if s.startswith(self.start):
            self._phase, self._buf = _REASONING, s[len(self.start):]
            return True
        if not final and self.start.startswith(s):
            return False
        self._phase = self._default
        self._lead = self._default == _REASONING  # content keeps what the model wrote
        return True

    def _reasoning(self, final: bool) -> str:
        if self._lead:
            self._buf = self._buf.lstrip()
            self._lead = not self._buf
        i = self._buf.find(self.end)
        if i >= 0:
            piece = self._buf[:i].rstrip()
            self._buf = self._buf[i + len(self.end):]
            self._phase, self._lead = _CONTENT, True
            return piece
        if final:
            piece, self._buf = self._buf.rstrip(), ""
            return piece
        # Hold what may be the start of the end tag, and trailing whitespace (it is
        # dropped if the tag follows).
        piece = held(self._buf, self.end).rstrip()
        self._buf = self._buf[len(piece):]
        return piece
