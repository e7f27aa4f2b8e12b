"""One token bitmask per step for the constrained rows, applied to their logits.

The bitmask is ``int32 [rows, ceil(vocab / 32)]`` (bit ``j`` of word ``w`` allows token
``32 * w + j``). It is applied without unpacking it into a boolean row per request: its
bytes index a ``[256, 8]`` table of additive masks (``0`` allowed, ``-inf`` forbidden),
one lookup for the whole batch, and the result is added to the logits in place. Adding
``0`` leaves an allowed logit exactly as it was. On the CPU the lookup and the add run
in numpy, in the calling thread: split across torch's intra-op threads, a few rows cost
more in waiting for the second thread (on a loaded machine, a scheduler time slice)
than in work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.engine.structured.backend import Matcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class TokenBitmask:
    """The step's bitmask buffer: allocated once (grown when a step has more constrained
    rows or a wider vocabulary than any before) and filled in place each step."""

    def __init__(self) -> None:
        self._buf = torch.empty((0, 0), dtype=torch.int32)

    def fill(self, matchers: Sequence[Matcher], vocab_size: int,
             pin_memory: bool = False) -> torch.Tensor:
        """``int32 [len(matchers), ceil(vocab / 32)]``: each matcher's allowed next tokens
        (a view of the buffer, valid until the next :meth:`fill`)."""
        n, words = len(matchers), bitmask_words(vocab_size)
        if self._buf.shape[0] < n or self._buf.shape[1] != words or (
                pin_memory and not self._buf.is_pinned()):
            rows = max(n, self._buf.shape[0] if self._buf.shape[1] == words else 0)
            self._buf = torch.empty((rows, words), dtype=torch.int32, pin_memory=pin_memory)
        bm = self._buf[:n]
        for i, m in enumerate(matchers):
            m.fill_bitmask(bm, i)
        return bm


def fill(matchers: Sequence[Matcher], vocab_size: int) -> torch.Tensor:
    """A fresh ``int32 [len(matchers), ceil(vocab / 32)]`` bitmask of ``matchers``."""
    return TokenBitmask().fill(matchers, vocab_size)


_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: for each byte value, ``0`` where its bit is set and ``-inf`` where not."""
    key = (device, dtype)
    t = _TABLES.get(key)
    if t is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        t = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf"))
        t = _TABLES.setdefault(key, t.to(device))
    return t


def apply(logits: torch.Tensor, rows: Sequence[int] | None, bitmask: torch.Tensor,
          rows_t: torch.Tensor | None = None) -> None:
    """Set to -inf, in ``logits[rows[i]]``, every token that row ``i`` of ``bitmask``
    does not allow; ``rows=None`` means every row of ``logits``, in order. Only those
    rows are written; columns past the mask (padding of the vocabulary) are masked.
    ``rows_t`` is ``rows`` already on the logits' device (the sampler stages it)."""
    n, vocab = bitmask.shape[0], logits.shape[1]
    if n == 0:
        return
    if rows is not None and len(rows) != n:
        raise ValueError(f"{n} bitmask rows for {len(rows)} logit rows")
    all_rows = rows is None or (n == logits.shape[0] and list(rows) == list(range(n)))
    width = min(vocab, 32 * bitmask.shape[1])
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and bitmask.is_cpu:
        _apply_numpy(logits.numpy(), None if all_rows else list(rows), bitmask, width)
        return
    # int32 words are little-endian: byte k of word w holds tokens 32w+8k .. 32w+8k+7.
    codes = bitmask.to(logits.device, non_blocking=True).view(torch.uint8).int()
    add = torch.nn.functional.embedding(codes.view(n, -1), _table(logits.device, logits.dtype))
    add = add.view(n, -1)[:, :width]
    if all_rows:
        logits[:, :width].add_(add)
        logits[:, width:] = float("-inf")
        return
    idx = rows_t if rows_t is not None else torch.tensor(list(rows), device=logits.device)
    logits[:, :width].index_add_(0, idx, add)
    if width < vocab:
        logits[idx, width:] = float("-inf")


def _apply_numpy(x: np.ndarray, rows: list[int] | None, bitmask: torch.Tensor,
                 width: int) -> None:
    n = bitmask.shape[0]
    table = _table(torch.device("cpu"), torch.float32).numpy()
    codes = bitmask.contiguous().numpy().view(np.uint8)
    add = np.take(table, codes, axis=0).reshape(n, -1)[:, :width]
    if rows is None:
        x[:, :width] += add
        x[:, width:] = -np.inf
    else:
        x[rows, :width] += add  # rows are distinct: one add per row
        x[rows, width:] = -np.inf
