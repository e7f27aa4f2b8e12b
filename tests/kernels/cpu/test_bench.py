"""``python -m kernels.cpu.bench --long``: the native kernel timed at long contexts."""

from __future__ import annotations

import logging
import re

import torch

from kernels.cpu import bench
from kernels.cpu import native as cpu_native


def test_long_context_bench_reports_each_case(caplog) -> None:
    level = cpu_native.runnable_levels()[-1]
    with caplog.at_level(logging.INFO, logger="kernels.cpu.bench"):
        bench.bench_long(level, torch.float32, iters=1, cpu_time=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6, lines
    for line, (ctx, q) in zip(lines, [(512, 512), (2048, 512), (8192, 512), (8192, 1),
                                      (32768, 1), (8192, 1)], strict=True):  # fmt: skip
        m = re.match(rf"{level}\s+ctx\s+{ctx}\S*\s+q\s+{q}: +([\d.]+) ms +([\d.]+) GFLOP/s +([\d.]+) GB/s",
                     line)  # fmt: skip
        assert m, line
        assert all(float(x) > 0 for x in m.groups()), line


def test_layers_bench_reads_the_engine_layout(caplog) -> None:
    level = cpu_native.runnable_levels()[-1]
    with caplog.at_level(logging.INFO, logger="kernels.cpu.bench"):
        bench.bench_layers(level, torch.float32, iters=1, layers=2, context=100)
    (line,) = [r.getMessage() for r in caplog.records]
    m = re.match(rf"{level}\s+2 layers x ctx 100 decode: +([\d.]+) ms +([\d.]+) GB/s", line)
    assert m and all(float(x) > 0 for x in m.groups()), line
