"""Incremental validation of one OpenAI SSE response body (framing, finish chunks, [DONE])."""

from __future__ import annotations

import json
import time
from typing import Any


class StreamChecker:
    """Incremental parser and validator of one OpenAI SSE response body.

    Feed it the body as it arrives (:meth:`feed`, any split of the bytes), then call
    :meth:`close`. It records the arrival time of every chunk that carries content
    (a reasoning model's ``delta.reasoning_content`` counts: it is generated text too),
    the generated text (:attr:`text`, the answer; :attr:`reasoning`, the thinking), the ``usage`` object, an in-stream ``error`` and every
    violation of the streaming contract:

    - an event that is not exactly ``data: <payload>`` followed by a blank line;
    - a payload that is not JSON (other than ``[DONE]``);
    - anything after ``data: [DONE]``, or a stream that ends without it;
    - a choice with zero or several chunks carrying a ``finish_reason``, or content after
      its finish chunk;
    - no ``usage`` when it was requested, or a usage-only chunk before a finish chunk.
    """

    def __init__(self, expected_choices: int = 1, expect_usage: bool = True) -> None:
        self.expected_choices = expected_choices
        self.expect_usage = expect_usage
        self.buffer = b""
        self.num_events = 0
        self.done = False
        self.closed = False
        self.content_times: list[float] = []
        self.text_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.finish_counts: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.violations: list[str] = []

    @property
    def text(self) -> str:
        """The concatenated content of every choice, in arrival order."""
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        """The concatenated ``reasoning_content`` of every choice, in arrival order."""
        return "".join(self.reasoning_parts)

    def _violation(self, msg: str) -> None:
        if msg not in self.violations:
            self.violations.append(msg)

    def feed(self, data: bytes, now: float | None = None) -> None:
        """Parse the complete events in ``data`` (plus what was buffered before)."""
        now = time.perf_counter() if now is None else now
        self.buffer += data
        while True:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                return
            event, self.buffer = self.buffer[:end], self.buffer[end + 2:]
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        self.num_events += 1
        if event.startswith(b":"):  # an SSE comment (keep-alive)
            return
        if not event.startswith(b"data: ") or b"\n" in event:
            self._violation(f"malformed SSE event: {event[:80]!r}")
            return
        payload = event[len(b"data: "):]
        if self.done:
            self._violation("event after [DONE]")
            return
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            self._violation(f"payload is not JSON: {payload[:80]!r}")
            return
        if not isinstance(chunk, dict):
            self._violation(f"payload is not a JSON object: {payload[:80]!r}")
            return
        if chunk.get("error") is not None:
            err = chunk["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            self._violation("chunk without a 'choices' list")
            return
        if chunk.get("usage") is not None:
            if self.usage is not None:
                self._violation("more than one chunk carries usage")
            self.usage = chunk["usage"]
            if not choices and len(self.finish_counts) < self.expected_choices:
                self._violation("usage chunk before the finish chunks")
        has_content = False
        for choice in choices:
            idx = int(choice.get("index", 0))
            delta = choice.get("delta")
            content = (delta.get("content") if isinstance(delta, dict)
                       else choice.get("text"))
            thought = delta.get("reasoning_content") if isinstance(delta, dict) else None
            if content or thought:
                if self.finish_counts.get(idx):
                    self._violation(f"choice {idx} has content after its finish chunk")
                if content:
                    self.text_parts.append(content)
                if thought:
                    self.reasoning_parts.append(thought)
                has_content = True
            if choice.get("finish_reason") is not None:
                self.finish_counts[idx] = self.finish_counts.get(idx, 0) + 1
                self.finish_reasons[idx] = choice["finish_reason"]
        if has_content:
            self.content_times.append(now)

    def close(self) -> list[str]:
        """Finish checking at the end of the body; the violations found."""
        if self.closed:
            return self.violations
        self.closed = True
        if self.buffer.strip():
            self._violation(f"body ends inside an event: {self.buffer[:80]!r}")
        if self.error is not None:
            return self.violations
        if not self.done:
            self._violation("stream ended without data: [DONE]")
        for idx in range(self.expected_choices):
            n = self.finish_counts.get(idx, 0)
            if n != 1:
                self._violation(f"choice {idx} has {n} finish chunks (expected exactly 1)")
        extra = sorted(set(self.finish_counts) - set(range(self.expected_choices)))
        if extra:
            self._violation(f"finish chunks for unexpected choice indices {extra}")
        if self.expect_usage and self.usage is None:
            self._violation("no usage although stream_options.include_usage was set")
        return self.violations


# -- one request -------------------------------------------------------------------------
