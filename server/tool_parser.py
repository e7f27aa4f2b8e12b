"""Tool calls out of generated text, the same whether it arrives whole or in pieces.

A parser is fed the text as it is generated and returns, each time, the new content and
the new ``delta.tool_calls`` entries (a call's ``id`` and ``name`` first, once the name
is complete, then its ``arguments`` in pieces). It re-reads everything fed so far and
emits only what is past what it emitted before, holding back text that may still turn
out to be markup, so the pieces of any split concatenate to the parse of the whole.
A whole response is the same parser fed once.

- ``hermes`` (``tool_choice="auto"``): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks in free text (Qwen2.5, Qwen3, Hermes); whitespace that touches a
  tag is dropped from the content.
- ``required``: a JSON array of ``{"name", "arguments"}`` objects (what the grammar of
  ``tool_choice="required"`` produces).
- ``named``: the text is the arguments of one call to a known function.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = re.compile(r'"arguments"\s*:\s*')


def scan_value(text: str, i: int) -> int | None:
    """The end of the JSON value that starts at ``text[i]``, or None if it is incomplete."""
    if i >= len(text):
        return None
    if text[i] not in "{[\"":
        m = re.compile(r"[^,}\]\s]*").match(text, i)
        return m.end() if m.end() < len(text) else None
    depth, in_str, esc = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


@dataclass(slots=True)
class CallView:
    name: str | None
    arguments: str
    """What is known of the arguments' JSON text (all of it once ``complete``)."""


def call_view(body: str, final: bool) -> CallView:
    """The name and arguments of one call object, complete or being generated."""
    m = _NAME.search(body)
    name = None
    if m:
        try:
            name = json.loads(m.group(1))
        except ValueError:
            name = None
    a = _ARGS.search(body)
    if a is None:
        return CallView(name, "{}" if final else "")
    end = scan_value(body, a.end())
    return CallView(name, body[a.end():end] if end is not None else body[a.end():])


def held(tail: str, marker: str) -> str:
    """``tail`` less a suffix that may be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(tail)), 0, -1):
        if marker.startswith(tail[-k:]):
            return tail[:-k]
    return tail


def hermes_view(text: str, final: bool) -> tuple[str, list[CallView]]:
    content: list[str] = []
    calls: list[CallView] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            tail = text[pos:]
            content.append(tail if final else held(tail, OPEN).rstrip())
            break
        content.append(text[pos:start].rstrip())
        end = text.find(CLOSE, start)
        body = text[start + len(OPEN):end if end >= 0 else len(text)]
        if end < 0 and not final:
            body = held(body, CLOSE)
        calls.append(call_view(body, final or end >= 0))
        if end < 0:
            break
        pos = end + len(CLOSE)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return "".join(content), calls


def array_view(text: str, final: bool) -> tuple[str, list[CallView]]:
    calls = []
    i = text.find("[")
    while i >= 0:
        start = text.find("{", i + 1)
        if start < 0:
            break
        end = scan_value(text, start)
        calls.append(call_view(text[start:end if end is not None else len(text)],
                               final or end is not None))
        if end is None:
            break
        i = end
    return "", calls


class ToolCallParser:
    """Feed text with :meth:`feed`, then :meth:`finish`; each returns
    ``(content piece, [delta.tool_calls entries])``."""

    def __init__(self, mode: str, function_name: str | None = None) -> None:
        if mode not in ("hermes", "required", "named"):
            raise ValueError(f"unknown tool call parser {mode!r}")
        self.mode = mode
        self.function_name = function_name
        self.text = ""
        self.content = ""
        self.calls: list[dict] = []
        """Calls emitted so far: ``{"id", "type", "function": {"name", "arguments"}}``."""

    def _view(self, final: bool) -> tuple[str, list[CallView]]:
        if self.mode == "hermes":
            return hermes_view(self.text, final)
        if self.mode == "required":
            return array_view(self.text, final)
        return "", [CallView(self.function_name, self.text)]

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        content, views = self._view(final)
        piece = content[len(self.content):]
        self.content = content
        deltas = []
        for k, v in enumerate(views):
            if v.name is None:
                break  # a call is announced once its name is known; later ones wait
            if k == len(self.calls):
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": v.name, "arguments": ""}}
                self.calls.append(call)
                deltas.append({"index": k, "id": call["id"], "type": "function",
                               "function": {"name": v.name, "arguments": v.arguments}})
                call["function"]["arguments"] = v.arguments
                continue
            known = self.calls[k]["function"]["arguments"]
            if len(v.arguments) > len(known):
                deltas.append({"index": k,
                               "function": {"arguments": v.arguments[len(known):]}})
                self.calls[k]["function"]["arguments"] = v.arguments
        return piece, deltas

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("", final=True)

    @property
    def final_content(self) -> str | None:
        """The whole content after :meth:`finish` (None when empty and calls were made)."""
        return self.content if self.content or not self.calls else None
