"""Prompt-lookup (n-gram) draft tokens for speculative decoding.

For a request's tokens ``t[0 .. L)``: the longest ``n`` in ``[prompt_lookup_max ..
prompt_lookup_min]`` whose last ``n`` tokens also occur earlier, ending before
``L - 1``; the draft is the up-to-``k`` tokens that followed their latest earlier
occurrence. Summaries, edits and code answers copy long runs of their prompt, which
this proposes for free (no draft model).

The search runs in C: the tokens are packed as 4-byte integers and ``bytes.rfind``
looks for the n-gram's bytes, keeping only matches on a token boundary. Torch-free.
"""

from __future__ import annotations

from array import array

_ITEM = 4  # bytes per packed token


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(self, tokens: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to ``min(k, max_drafts)`` draft tokens to follow ``tokens`` ([] if none)."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        length = len(tokens)
        if k <= 0 or length < self.n_min + 1:
            return []
        packed = array("I", tokens).tobytes()
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = _latest_earlier(packed, length, n)
            if start is not None:
                follow = start + n
                return tokens[follow:follow + k]
        return []


def _latest_earlier(packed: bytes, length: int, n: int) -> int | None:
    """Token index of the latest occurrence of the last ``n`` tokens that ends before
    the last token, or None."""
    pattern = packed[(length - n) * _ITEM:]
    end = (length - 1) * _ITEM  # a match must end at or before token L - 2
    while True:
        pos = packed.rfind(pattern, 0, end)
        if pos < 0:
            return None
        if pos % _ITEM == 0:
            return pos // _ITEM
        end = pos + len(pattern) - 1  # straddles tokens: look further back
