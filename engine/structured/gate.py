"""A grammar that applies after the model's reasoning (:class:`ReasoningGate`).

The matcher wraps the grammar's own: inside the reasoning every token is allowed and
none reaches the grammar; from the token after the end tag on, the grammar masks and
accepts as usual. Before the first token of an output whose prompt did not open the
reasoning, the grammar's mask is widened by the start tag's token: the model may open
its reasoning, or start the grammar's text at once. Rollback undoes grammar tokens
first, then reasoning tokens, so the state follows the tokens kept.
"""

from __future__ import annotations

from typing import Any

from pagedserve.engine.structured.backend import Matcher
from pagedserve.engine.structured.params import ReasoningGate


def allow_token(bitmask: Any, row: int, token_id: int) -> None:
    """Set token ``token_id``'s bit in row ``row`` of an int32 bitmask."""
    word, bit = divmod(token_id, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class GatedMatcher:
    __slots__ = ("_inner", "_gate", "_free", "_grammar_tokens")

    def __init__(self, inner: Matcher, gate: ReasoningGate) -> None:
        self._inner = inner
        self._gate = gate
        self._free: list[int] = []
        """Tokens taken outside the grammar: the start tag (if generated), the reasoning
        and its end tag."""
        self._grammar_tokens = 0

    @property
    def in_grammar(self) -> bool:
        """The grammar applies to the next token."""
        if self._grammar_tokens:
            return True
        gate, free = self._gate, self._free
        if not free:
            return False
        opened = 0 if gate.started else 1  # the generated start tag
        n = len(gate.end)
        return len(free) >= opened + n and tuple(free[-n:]) == gate.end

    @property
    def _undecided(self) -> bool:
        return not self._gate.started and not self._free and not self._grammar_tokens

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self.in_grammar or self._undecided:
            self._inner.fill_bitmask(bitmask, row)
            if self._undecided:
                allow_token(bitmask, row, self._gate.start)
        else:
            bitmask[row] = -1

    def accept_token(self, token_id: int) -> bool:
        if self._undecided and token_id != self._gate.start or self.in_grammar:
            if not self._inner.accept_token(token_id):
                return False
            self._grammar_tokens += 1
            return True
        self._free.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        k = min(num_tokens, self._grammar_tokens)
        if k:
            self._inner.rollback(k)
            self._grammar_tokens -= k
        rest = num_tokens - k
        if rest:
            del self._free[len(self._free) - rest:]

    def is_terminated(self) -> bool:
        return self.in_grammar and self._inner.is_terminated()
