"""The native kernels' thread pool (``csrc/pool.c``): its workers take part, a forked
child still computes (with no workers), and concurrent callers are serialized."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pagedserve.kernels.cpu.quant import native_linear
from tests.helpers.quant import assert_product_close, random_weight


def test_workers_start_on_first_use_and_results_hold(native_lib) -> None:
    w = random_weight("q4_1", 512, 256, seed=2)
    x = torch.randn(8, 256)
    for threads in (1, 2, 3):
        assert_product_close(native_linear(native_lib, x, w, None, threads), x, w, None)
    assert native_lib.pool_size() >= 3


def test_a_forked_child_computes_without_workers(native_lib) -> None:
    w = random_weight("q8_0", 300, 128, seed=4)
    x = torch.randn(5, 128)
    native_linear(native_lib, x, w, None, 2)  # the parent's pool has a worker now
    pid = os.fork()
    if pid == 0:  # child: no pool threads survive the fork; the caller does every chunk
        torch.set_num_threads(1)  # libgomp's own pool does not survive a fork either
        ok = torch.allclose(native_linear(native_lib, x, w, None, 2),
                            x @ w.dequantize().T, atol=1e-4, rtol=1e-4)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_concurrent_callers_get_their_own_results(native_lib) -> None:
    weights = [random_weight(f, 200, 96, seed=i) for i, f in enumerate(("q4_0", "int8", "q8_0"))]
    xs = [torch.randn(3, 96) for _ in weights]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(50):
                out = native_linear(native_lib, xs[i], weights[i], None, 2)
                assert_product_close(out, xs[i], weights[i], None)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(weights))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("spin_us", [0, 5000])
def test_spin_setting_changes_nothing_but_timing(native_lib, spin_us) -> None:
    w = random_weight("q4_1", 64, 64, seed=1)
    x = torch.randn(2, 64)
    native_lib.pool_set_spin_us(spin_us)
    try:
        assert_product_close(native_linear(native_lib, x, w, None, 2), x, w, None)
    finally:
        native_lib.pool_set_spin_us(300)
