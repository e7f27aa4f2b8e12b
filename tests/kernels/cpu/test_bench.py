"""``python -m pagedserve.kernels.cpu.bench --long``: the native kernel timed at long contexts."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from pagedserve.kernels.cpu import bench
from pagedserve.kernels.cpu import native as cpu_native


def test_long_context_bench_reports_each_case(caplog) -> None:
    level = cpu_native.runnable_levels()[-1]
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu.bench"):
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
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu.bench"):
        bench.bench_layers(level, torch.float32, iters=1, layers=2, contexts=[100])
    (line,) = [r.getMessage() for r in caplog.records]
    m = re.match(rf"{level}\s+2 layers x ctx 100 decode: +([\d.]+) ms +([\d.]+) GB/s", line)
    assert m and all(float(x) > 0 for x in m.groups()), line


def test_layers_bench_counts_an_int8_caches_codes_and_scales(caplog) -> None:
    """An int8 cache's GB/s counts 68 bytes a 64-wide row (codes and scale): at the same
    time it would report 68/256 of a float32 cache's rate."""
    level = cpu_native.runnable_levels()[-1]
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu.bench"):
        bench.bench_layers(level, torch.int8, iters=1, layers=2, contexts=[100])
    (record,) = caplog.records
    line = record.getMessage()
    assert re.match(rf"{level}\s+2 layers x ctx 100 decode: +([\d.]+) ms +([\d.]+) GB/s", line)
    assert record.args[4] == pytest.approx(2 * 2 * 100 * 3 * 68 / record.args[3] / 1e6)


def test_layers_bench_takes_a_batch_of_requests(caplog) -> None:
    """A batch's line names its requests and contexts; its GB/s counts every request's
    K/V (a bench reading one request's would report a third of this rate)."""
    level = cpu_native.runnable_levels()[-1]
    contexts = [40, 17, 100]
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu.bench"):
        bench.bench_layers(level, torch.float32, iters=1, layers=2, contexts=contexts)
    (record,) = caplog.records
    line = record.getMessage()
    m = re.match(rf"{level}\s+2 layers x 3 requests, ctx 17-100, decode: +([\d.]+) ms +([\d.]+) "
                 r"GB/s", line)  # fmt: skip
    assert m, line
    kv_bytes = 2 * 2 * sum(contexts) * 3 * 64 * 4  # K and V, 2 layers, 3 KV heads, dim 64
    assert record.args[4] == pytest.approx(kv_bytes / record.args[3] / 1e6)
    batch = bench._batch_contexts()
    assert len(batch) == 64 and all(100 <= n <= 400 for n in batch)


def test_layers_bench_gives_each_request_its_own_blocks() -> None:
    """Requests sharing blocks would be timed on K/V already in cache."""
    table = bench.block_table([3, 1, 2])
    assert table.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]


def test_layers_bench_times_another_build_in_turn(caplog) -> None:
    level = cpu_native.runnable_levels()[0]
    other = cpu_native.build_library(level)._name  # any build: here the same one, by path
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu.bench"):
        bench.bench_layers(level, torch.float32, iters=2, layers=2, contexts=[100],
                           against=other)
    mine, theirs = caplog.records
    assert re.match(rf"{level}\s+2 layers x ctx 100 decode: +[\d.]+ ms", mine.getMessage())
    m = re.match(rf"{re.escape(other)} 2 layers x ctx 100 decode: +[\d.]+ ms .*\(([\d.]+)x "
                 r"this tree's\)$", theirs.getMessage())  # fmt: skip
    assert m, theirs.getMessage()
    ms_mine, ms_theirs = mine.args[3], theirs.args[3]  # the unrounded times
    assert float(m.group(1)) == pytest.approx(ms_theirs / ms_mine, abs=0.006)


def test_long_context_bench_times_another_build_on_every_case(caplog) -> None:
    level = cpu_native.runnable_levels()[0]
    other = cpu_native.build_library(level)._name
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu.bench"):
        bench.bench_long(level, torch.float32, iters=1, cpu_time=True, against=other)
    records = caplog.records
    assert len(records) == 12  # each case: this tree's line, then the other build's
    for mine, theirs in zip(records[::2], records[1::2], strict=True):
        assert mine.args[0] == level and theirs.args[0] == other
        assert mine.args[1:4] == theirs.args[1:4]  # the same case
        m = re.search(r"\(([\d.]+)x this tree's\)$", theirs.getMessage())
        assert m, theirs.getMessage()
        assert float(m.group(1)) == pytest.approx(theirs.args[4] / mine.args[4], abs=0.006)


def test_the_bench_runs_again_with_the_engine_spin_unless_the_wait_is_set(monkeypatch) -> None:
    """Without ``GOMP_SPINCOUNT``, libgomp's idle thread would hold the second core after
    every torch op and halve a two-thread kernel timed right after one."""
    calls = []
    monkeypatch.setattr(bench.os, "execv", lambda exe, argv: calls.append((exe, argv)))
    monkeypatch.setattr(bench.sys, "argv", ["bench.py", "--long", "--threads", "2"])
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    bench._run_with_engine_spin()
    assert calls == [(bench.sys.executable, [bench.sys.executable, "-m", "pagedserve.kernels.cpu.bench",
                                             "--long", "--threads", "2"])]  # fmt: skip
    assert bench.os.environ["GOMP_SPINCOUNT"] == "1000"
    # Set already (this run, or the caller's choice): runs as it is.
    bench._run_with_engine_spin()
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    bench._run_with_engine_spin()
    assert len(calls) == 1


def assert_timed_cells(line: str, rows: list[str]) -> None:
    """A qgemm_bench line's cells ``rows: a/b (ratio)``: one per row count, in order, both
    times positive."""
    cells = re.findall(r"(\d+): ([0-9.]+)/([0-9.]+) \(([0-9.]+)\)", line)
    assert [c[0] for c in cells] == rows
    assert all(float(a) > 0 and float(b) > 0 for _, a, b, _ in cells)


def test_qgemm_bench_times_every_kept_format_both_ways(caplog) -> None:
    """``--qgemm``: one line per format and shape, each row count timed with float and
    with 8-bit activations and their ratio."""
    from pagedserve.kernels.cpu import native as cpu_native
    from pagedserve.kernels.quant import FORMATS
    from pagedserve.loadtest.qgemm_bench import bench_qgemm

    with caplog.at_level(logging.INFO, logger="pagedserve.loadtest.qgemm_bench"):
        bench_qgemm(cpu_native.runnable_levels()[-1], 1, rows=(1, 3), shapes=((16, 256),))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("quantized linears, build level ")
    timed = lines[1:]
    assert [line.split()[0] for line in timed] == [f for f in FORMATS if f != "int8"]
    for line in timed:
        assert "[  16,  256]" in line
        assert_timed_cells(line, ["1", "3"])


def test_qgemm_bench_times_the_integer_products_against_dequantized(caplog) -> None:
    """``--vs-dequantized``: one line per 8-bit-activation format and shape, each row
    count timed both ways with their ratio."""
    from pagedserve.kernels.cpu import native as cpu_native
    from pagedserve.kernels.cpu.quant import INT8_ACTIVATION_FORMATS
    from pagedserve.loadtest.qgemm_bench import bench_limits

    with caplog.at_level(logging.INFO, logger="pagedserve.loadtest.qgemm_bench"):
        bench_limits(cpu_native.runnable_levels()[-1], 1, rows=(2, 5), shapes=((16, 256),))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("8-bit products against the dequantized weight's")
    assert [line.split()[0] for line in lines[1:]] == list(INT8_ACTIVATION_FORMATS)
    for line in lines[1:]:
        assert_timed_cells(line, ["2", "5"])


def test_qgemm_bench_times_vnni_against_maddubs(caplog) -> None:
    """``--vnni-vs-maddubs``: one line per 8-bit-activation format and shape, each row count
    timed both ways (outputs compared bit for bit); where this build or CPU lacks VNNI, a
    ValueError naming what there is, before any timing."""
    from pagedserve.kernels.cpu import native as cpu_native
    from pagedserve.kernels.cpu.quant import INT8_ACTIVATION_FORMATS
    from pagedserve.loadtest.qgemm_bench import bench_dots

    level = cpu_native.runnable_levels()[-1]
    lib = cpu_native.build_library(level)
    before = cpu_native.int8_dots(lib)
    if "vnni" not in cpu_native.int8_dots_available(lib):
        with pytest.raises(ValueError, match="int8 dots 'vnni' are not available"):
            bench_dots(level, 1, rows=(2, 5), shapes=((16, 256),))
        return
    with caplog.at_level(logging.INFO, logger="pagedserve.loadtest.qgemm_bench"):
        bench_dots(level, 1, rows=(2, 5), shapes=((16, 256),))
    assert cpu_native.int8_dots(lib) == before
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("8-bit products, vnni dots against maddubs")
    assert [line.split()[0] for line in lines[1:]] == list(INT8_ACTIVATION_FORMATS)
    for line in lines[1:]:
        assert_timed_cells(line, ["2", "5"])
