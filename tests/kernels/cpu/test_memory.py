"""``pagedserve.kernels.cpu.memory``: tensors on fresh, huge-page-aligned mappings."""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.memory import HUGE_PAGE, huge_empty


def test_a_large_tensor_starts_on_a_huge_page_after_the_advice() -> None:
    calls = []
    t = huge_empty((3, HUGE_PAGE // 4 + 5), torch.float32, lambda mm, n: calls.append(n))
    # 3 huge pages and 60 bytes, advised in whole huge pages.
    assert calls == [4 * HUGE_PAGE]
    assert t.shape == (3, HUGE_PAGE // 4 + 5) and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert t.count_nonzero().item() == 0  # fresh memory reads as zeros
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * t.numel()


def test_a_small_tensor_is_an_ordinary_one() -> None:
    calls = []
    t = huge_empty((100,), torch.bfloat16, lambda mm, n: calls.append(n))
    assert calls == [] and t.shape == (100,) and t.dtype == torch.bfloat16
