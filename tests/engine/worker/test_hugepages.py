"""The CPU KV cache's allocation on transparent huge pages."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from pagedserve.engine import envs
from pagedserve.engine.worker import hugepages

MIB = 1 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds ``t``'s first byte."""
    addr, found = t.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= addr < hi
        elif found and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


@pytest.fixture
def advised(monkeypatch) -> list:
    """Huge pages on; records each advised mapping's length."""
    monkeypatch.delenv(envs.HUGEPAGES.name, raising=False)
    if not hugepages.enabled():
        pytest.skip("no madvise(MADV_HUGEPAGE) on this platform")
    calls: list[int] = []
    real = hugepages.advise_huge_pages
    monkeypatch.setattr(hugepages, "advise_huge_pages",
                        lambda mm, length: calls.append(len(mm)) or real(mm, length))
    return calls


def test_large_buffers_are_fresh_advised_and_start_on_a_huge_page(advised) -> None:
    t = hugepages.empty((5, 3, MIB // 4), torch.float32)  # 15 MiB: not whole pages
    assert t.shape == (5, 3, MIB // 4) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert advised == [18 * MIB]  # 16 MiB of whole pages, and one to align the start
    assert t.abs().sum().item() == 0
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * t.numel()


def test_small_buffers_or_the_switch_off_take_plain_memory(advised, monkeypatch) -> None:
    small = hugepages.empty((1000,), torch.bfloat16)
    assert small.shape == (1000,) and small.dtype == torch.bfloat16
    monkeypatch.setenv(envs.HUGEPAGES.name, "0")
    big = hugepages.empty((4, MIB), torch.float32)
    assert big.shape == (4, MIB) and big.is_contiguous()
    assert advised == []


def test_a_refused_advice_still_gives_the_buffer(advised, monkeypatch, caplog) -> None:
    def refuse(mm, length) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(hugepages, "advise_huge_pages", refuse)
    with caplog.at_level("DEBUG", logger="pagedserve.engine.worker.hugepages"):
        t = hugepages.empty((3 * MIB,), torch.float32)
    assert t.numel() == 3 * MIB and t.fill_(2.0).sum().item() == 6 * MIB
    assert "madvise(MADV_HUGEPAGE) of 12582912 bytes failed" in caplog.text


@pytest.mark.skipif(not THP_SETTING.exists()
                    or not any(f"[{m}]" in THP_SETTING.read_text() for m in ("madvise", "always")),
                    reason="this kernel gives no transparent huge pages on request")  # fmt: skip
def test_touched_pages_are_huge(monkeypatch) -> None:
    monkeypatch.delenv(envs.HUGEPAGES.name, raising=False)
    # Reused heap memory (freed by earlier tests) would already sit on small pages.
    junk = [torch.ones(8 * MIB, dtype=torch.uint8) for _ in range(8)]
    del junk
    t = hugepages.empty((40 * MIB,), torch.uint8).zero_()
    assert _huge_kb(t) >= 20 * 1024
