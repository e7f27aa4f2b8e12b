"""The token bitmask: applied in place to exactly the constrained rows, every forbidden
token (and every padding column past the mask) at -inf, every allowed logit unchanged."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.structured import bitmask


class _Fixed:
    """A matcher that allows a fixed set of tokens."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bm: torch.Tensor, row: int) -> None:
        words = [0] * bm.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bm[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                               dtype=torch.int32)


def _expected(logits: torch.Tensor, rows: list[int], allowed: list[set[int]]) -> torch.Tensor:
    want = logits.clone()
    for r, a in zip(rows, allowed, strict=True):
        for t in range(logits.shape[1]):
            if t not in a:
                want[r, t] = float("-inf")
    return want


# float32 on the CPU goes through numpy; other dtypes (and devices) through torch ops.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 3], [4, 0]])
def test_apply_masks_exactly_the_forbidden_tokens_of_its_rows(rows, dtype):
    vocab = 200  # 7 words of 32, the last one partly padding
    g = torch.Generator().manual_seed(0)
    allowed = [set(torch.randint(0, vocab, (40,), generator=g).tolist()) | {31, 32, 199}
               for _ in rows]
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    mask = bitmask.fill([_Fixed(a) for a in allowed], vocab)
    assert mask.shape == (len(rows), 7) and mask.dtype == torch.int32
    x = logits.clone()
    bitmask.apply(x, None if rows == [0, 1, 2, 3, 4] else rows, mask)
    assert torch.equal(x, _expected(logits, rows, allowed))
    untouched = [r for r in range(5) if r not in rows]
    assert torch.equal(x[untouched], logits[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columns_past_the_mask_are_masked(dtype):
    """Logits wider than the mask (vocabulary padding): the extra columns are -inf."""
    logits = torch.randn(3, 70).to(dtype)
    mask = bitmask.fill([_Fixed({0, 63}), _Fixed({5})], 64)
    x = logits.clone()
    bitmask.apply(x, [2, 0], mask)
    assert torch.equal(x, _expected(logits, [2, 0], [{0, 63}, {5}]))
    x = logits[:2].clone()
    bitmask.apply(x, None, mask)
    assert torch.equal(x, _expected(logits[:2], [0, 1], [{0, 63}, {5}]))


def test_buffer_is_allocated_once_and_refilled():
    tb = bitmask.TokenBitmask()
    a = tb.fill([_Fixed({1})] * 4, 100)
    ptr = a.data_ptr()
    b = tb.fill([_Fixed({2}), _Fixed({3})], 100)
    assert b.data_ptr() == ptr and b.shape == (2, 4)
    assert b[:, 0].tolist() == [4, 8]
    c = tb.fill([_Fixed({4})] * 8, 100)  # more rows than before: grown once
    assert c.shape == (8, 4) and tb.fill([_Fixed({5})], 100).data_ptr() == c.data_ptr()


def test_row_count_mismatch_is_an_error():
    mask = bitmask.fill([_Fixed({1})], 64)
    with pytest.raises(ValueError, match="1 bitmask rows for 2 logit rows"):
        bitmask.apply(torch.zeros(3, 64), [0, 1], mask)
