"""Stop strings over streamed text."""

from __future__ import annotations


class StopChecker:
    """Stop strings over streamed text. Text that might be the start of a stop string is held
    back until it is known not to be one, so a stop string never reaches the client, not even
    partly.

    The match is the stop string that is *completed* first as the text streams (generation
    stops at that point); among matches completed by the same character the one starting
    earliest wins. The result does not depend on how the text is split into deltas.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stop) if s]
        self._include = include_stop_str_in_output
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._matched

    @property
    def stopped(self) -> bool:
        return self._matched is not None

    def feed(self, delta: str, match: bool = True) -> tuple[str, str | None]:
        """Add text; return (text safe to emit now, matched stop string or None).

        After a match the emitted text ends right before the stop string (or right after
        it with ``include_stop_str_in_output``) and later calls emit nothing. With
        ``match=False`` (before ``min_tokens``) nothing matches, but the start of a stop
        string is still held back: a stop string completed by a later call may begin in
        this text.
        """
        if self._matched is not None:
            return "", None
        if not self._stops:
            return delta, None
        buf = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        old = len(self._held)
        for s in self._stops if match else ():
            # Only a stop string completed by this delta: one inside the held text was
            # completed while matching was off.
            start = buf.find(s, max(0, old - len(s) + 1))
            if start >= 0:
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, s = best
            self._matched = s
            self._held = ""
            return buf[: end if self._include else start], s
        keep = self._pending_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def _pending_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At finish (EOS/length) release the held-back text."""
        if self._matched is not None:
            return ""
        held, self._held = self._held, ""
        return held
