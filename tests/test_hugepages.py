"""The CPU KV cache's allocation on transparent huge pages."""

from __future__ import annotations

import errno
import platform
from pathlib import Path

import pytest
import torch

from engine import hugepages

MIB = 1 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _no_madvise(addr: int, length: int) -> int:
    raise AssertionError("madvise was called")


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


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise is Linux's")
def test_large_buffers_start_on_a_huge_page_and_are_advised(monkeypatch) -> None:
    monkeypatch.delenv(hugepages.ENV_VAR, raising=False)
    calls = []
    real = hugepages._madvise
    monkeypatch.setattr(hugepages, "_madvise", lambda a, n: calls.append((a, n)) or real(a, n))
    t = hugepages.empty((5, 3, MIB // 4), torch.float32)  # 15 MiB, not a whole number of pages
    assert t.shape == (5, 3, MIB // 4) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert calls == [(t.data_ptr(), 16 * MIB)]
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * t.numel()


def test_small_buffers_or_the_switch_off_take_plain_memory(monkeypatch) -> None:
    monkeypatch.setattr(hugepages, "_madvise", _no_madvise)
    monkeypatch.delenv(hugepages.ENV_VAR, raising=False)
    small = hugepages.empty((1000,), torch.bfloat16)
    assert small.shape == (1000,) and small.dtype == torch.bfloat16
    monkeypatch.setenv(hugepages.ENV_VAR, "0")
    big = hugepages.empty((4, MIB), torch.float32)
    assert big.shape == (4, MIB) and big.is_contiguous()


def test_a_refused_advice_still_gives_the_buffer(monkeypatch, caplog) -> None:
    monkeypatch.delenv(hugepages.ENV_VAR, raising=False)
    monkeypatch.setattr(hugepages, "_madvise", lambda a, n: errno.EINVAL)
    monkeypatch.setattr(hugepages, "enabled", lambda: True)
    with caplog.at_level("DEBUG", logger="engine.hugepages"):
        t = hugepages.empty((3 * MIB,), torch.float32)
    assert t.numel() == 3 * MIB and t.zero_().abs().sum().item() == 0
    assert "madvise(MADV_HUGEPAGE) of 12582912 bytes failed" in caplog.text


@pytest.mark.skipif(not THP_SETTING.exists()
                    or not any(f"[{m}]" in THP_SETTING.read_text() for m in ("madvise", "always")),
                    reason="this kernel gives no transparent huge pages on request")  # fmt: skip
def test_touched_pages_are_huge(monkeypatch) -> None:
    monkeypatch.delenv(hugepages.ENV_VAR, raising=False)
    # Past glibc's largest mmap threshold (32 MiB): fresh pages, never touched before.
    t = hugepages.empty((40 * MIB,), torch.uint8).zero_()
    assert _huge_kb(t) >= 20 * 1024
