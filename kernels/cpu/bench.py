"""CPU benchmark: TorchBackend vs a naive per-request loop on SmolLM2-135M shapes.

Run with ``python -m pagedserve.kernels.cpu.bench``. Reports the best-of-N milliseconds per
layer forward (prepare runs once per step and is reported separately).

``--long`` times the native attention kernel alone at long contexts instead: prefill
chunks of 512 tokens at the end of 512-8192-token contexts (GFLOP/s of the causal
products), decodes of long contexts (GB/s of K/V read), and one 7,864-token decode
through 30 layers laid out as the engine's KV cache (huge pages, blocks in order), then a
64-request decode batch at contexts of 100-400 the same way.
``--threads 1 --cpu-time`` measures one core by its thread CPU time, which holds on a
machine shared with other work. ``--against LIB.so`` times another build of the library
(an earlier commit's) on every case in turn with this tree's, and prints the ratio.

It runs with ``GOMP_SPINCOUNT=1000``, as ``pagedserve`` runs the engine: unless that or
``OMP_WAIT_POLICY`` is set already, it starts itself again with it set (libgomp reads it
once, when torch loads). With libgomp's default spin, torch's idle OpenMP thread keeps
the second core busy for milliseconds after every torch op, and a two-thread kernel
called right after one runs at about one thread's speed.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.synthetic import PagedStep, make_step
from pagedserve.kernels.interface import AttentionMetadata
from pagedserve.kernels.torch_backend import TorchBackend

log = logging.getLogger("pagedserve.kernels.cpu.bench")


def naive_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Per-request loop: write, gather the context through the block table, SDPA."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    valid = meta.slot_mapping >= 0
    k_flat[meta.slot_mapping[valid]] = key[valid]
    v_flat[meta.slot_mapping[valid]] = value[valid]
    out = torch.zeros_like(query)
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(seq_len)
        slots = meta.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k, v = k_flat[slots].transpose(0, 1), v_flat[slots].transpose(0, 1)
        q = query[qsl[i] : qsl[i + 1]].transpose(0, 1)
        q_len = q.shape[1]
        mask = pos[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[qsl[i] : qsl[i + 1]] = o.transpose(0, 1)
    return out


def _time_ms(fn: Callable[[], object], iters: int) -> float:
    """Best of ``iters`` runs: robust to noise from other work on a shared machine."""
    fn()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench_step(name: str, step: PagedStep, iters: int) -> dict[str, float]:
    """Time prepare, TorchBackend.forward and the naive loop on one step."""
    backend = TorchBackend()
    args = (step.query, step.key, step.value, step.k_cache, step.v_cache, step.meta, step.scale)
    backend.prepare(step.meta, step.block_size)
    torch.testing.assert_close(backend.forward(*args), naive_forward(*args), atol=1e-4, rtol=1e-4)
    result = {
        "prepare_ms": _time_ms(lambda: backend.prepare(step.meta, step.block_size), iters),
        "backend_ms": _time_ms(lambda: backend.forward(*args), iters),
        "naive_ms": _time_ms(lambda: naive_forward(*args), iters),
    }
    log.info(
        "%-34s prepare %.2f ms | forward/layer: backend %.2f ms, naive loop %.2f ms (x%.1f)",
        name, result["prepare_ms"], result["backend_ms"], result["naive_ms"],
        result["naive_ms"] / result["backend_ms"],
    )  # fmt: skip
    return result


def bench_long(level: str, dtype: torch.dtype, iters: int, cpu_time: bool,
               against: str | None = None) -> None:
    """The native kernel at long contexts: prefill chunks and decodes. ``against``:
    another build of the library, timed in turn with this tree's on each case (each
    reported with its ratio to this tree's)."""
    from pagedserve.kernels.cpu import abi
    from pagedserve.kernels.cpu import native as cpu_native

    libs = {level: cpu_native.build_library(level)}
    if against is not None:
        libs[against] = ctypes.CDLL(against)
        abi.declare(libs[against])
    clock = time.thread_time if cpu_time else time.perf_counter
    from pagedserve.kernels.interface import kv_row_width
    from pagedserve.kernels.torch_ref import quantize_kv_rows

    # An int8 cache is the float32 step's values quantized (codes and a scale a row).
    shapes = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                  dtype=torch.float32 if dtype == torch.int8 else dtype)  # fmt: skip
    row_bytes = kv_row_width(64, dtype) * torch.empty((), dtype=dtype).element_size()
    # Decodes: a context in the L3 (8192 tokens: 12.6 MB of K/V here) and one past it
    # (32768: 50 MB, read from memory as a long request's layers are).
    cases = [([512], [512]), ([2048], [512]), ([8192], [512]), ([8192], [1]), ([32768], [1]),
             ([8192] + [300] * 31, [1] * 32)]
    for seq, q in cases:
        st = make_step(seq, q, **shapes)
        m = st.meta
        caches = (st.k_cache, st.v_cache) if dtype != torch.int8 else (
            quantize_kv_rows(st.k_cache), quantize_kv_rows(st.v_cache))

        def call(lib, st=st, m=m, seq=seq, caches=caches) -> None:
            cpu_native.paged_attention(lib, st.query, *caches, m.block_tables,
                                       m.seq_lens, max(seq), st.scale,
                                       query_start_loc=m.query_start_loc)  # fmt: skip

        best = dict.fromkeys(libs, float("inf"))
        for _ in range(iters):
            for name, lib in libs.items():  # in turn: the machine's state is shared
                for _ in range(2):  # warm: the caches, and this library's pool awake
                    call(lib)
                start = clock()
                call(lib)
                best[name] = min(best[name], clock() - start)
        # Causal products: token j of a chunk sees (context - q_len + 1 + j) rows.
        flops = sum(4 * 9 * 64 * sum(n - k + 1 + j for j in range(k)) for n, k in zip(seq, q, strict=True))
        kv = sum(2 * 3 * row_bytes * n for n in seq)
        for name, t in best.items():
            ratio = f"  ({t / best[level]:.2f}x this tree's)" if name != level else ""
            log.info("%-6s ctx %5d%-4s q %4d: %8.2f ms  %6.1f GFLOP/s  %6.2f GB/s%s", name, seq[0],
                     f"+{len(seq) - 1}" if len(seq) > 1 else "", q[0], t * 1e3,
                     flops / t / 1e9, kv / t / 1e9, ratio)  # fmt: skip


def bench_layers(level: str, dtype: torch.dtype, iters: int, layers: int = 30,
                 contexts: Sequence[int] = (7864,), against: str | None = None) -> None:
    """One decode step through every layer, as the engine lays it out: one cache per
    layer on huge pages, each KV head's rows of a block contiguous
    (``CpuBackend.kv_heads_first``), each request's blocks in order, one request a
    context of ``contexts`` (GB/s of K/V read).

    ``against``: another build of the native library (e.g. an earlier commit's, whose
    ``paged_attention`` takes this tree's arguments: it is declared with this tree's
    ABI), timed in turn with this tree's on the same cache, so that the two share the
    machine's state of the moment; each is reported with its ratio to this tree's."""
    from pagedserve.kernels.cpu import abi
    from pagedserve.kernels.cpu import native as cpu_native
    from pagedserve.kernels.cpu.backend import CpuBackend
    from pagedserve.kernels.cpu.memory import huge_empty
    from pagedserve.kernels.interface import allocate_kv_cache, kv_row_width
    from pagedserve.kernels.torch_ref import quantize_kv_rows

    libs = {level: cpu_native.build_library(level)}
    if against is not None:
        libs[against] = ctypes.CDLL(against)
        abi.declare(libs[against])
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    per_request = [-(-n // block_size) for n in contexts]
    num_blocks = sum(per_request) + 1  # block 0 unused, as the engine's padding
    width = kv_row_width(head_dim, dtype)
    cache = allocate_kv_cache((layers, 2, num_blocks, block_size, num_kv_heads, width),
                              CpuBackend.kv_heads_first, lambda dims: huge_empty(dims, dtype))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.int8:  # normal values quantized, a layer at a time
        for layer in cache:
            layer.copy_(quantize_kv_rows(torch.randn(*layer.shape[:-1], head_dim, generator=gen)))
    else:
        cache.normal_(generator=gen)
    table = block_table(per_request)
    lens = torch.tensor(contexts, dtype=torch.int32)
    query = torch.randn(len(contexts), num_heads, head_dim)

    def step(lib: ctypes.CDLL) -> None:
        for layer in range(layers):
            cpu_native.paged_attention(lib, query, cache[layer, 0], cache[layer, 1], table,
                                       lens, max(contexts), head_dim**-0.5)  # fmt: skip

    best = {name: float("inf") for name in libs}
    for lib in libs.values():
        step(lib)
    for _ in range(iters):
        for name, lib in libs.items():
            start = time.perf_counter()
            step(lib)
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    kv = 2 * layers * sum(contexts) * num_kv_heads * width * cache.element_size()
    what = (f"ctx {contexts[0]}" if len(contexts) == 1
            else f"{len(contexts)} requests, ctx {min(contexts)}-{max(contexts)},")
    for name, ms in best.items():
        ratio = "" if name == level else f"  ({ms / best[level]:.2f}x this tree's)"
        log.info("%-6s %d layers x %s decode: %8.2f ms  %6.2f GB/s (%d threads)%s", name,
                 layers, what, ms, kv / ms / 1e6, torch.get_num_threads(), ratio)  # fmt: skip


def block_table(per_request: Sequence[int]) -> torch.Tensor:
    """Each request's blocks in order, one request after another from block 1 (block 0
    is the engine's padding), padded with 0: ``[len(per_request), max(per_request)]``."""
    table = torch.zeros(len(per_request), max(per_request), dtype=torch.int32)
    first = 1
    for row, n in enumerate(per_request):
        table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    return table


def _batch_contexts() -> list[int]:
    """The contexts of a 64-request decode batch, 100-400 tokens (seed 0)."""
    return torch.randint(100, 401, (64,), generator=torch.Generator().manual_seed(0)).tolist()


def _omp_wait() -> str:
    return " ".join(f"{k}={os.environ[k]}" for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
                    if k in os.environ)


SPIN_COUNT = "1000"
"""The OpenMP threads' idle spin the engine runs with (``pagedserve.engine.worker.process_tuning``)."""


def _run_with_engine_spin() -> None:
    """Start this benchmark again with ``GOMP_SPINCOUNT`` set, unless the OpenMP wait is
    set already (by the caller, or by this function before it started again)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    os.execv(sys.executable, [sys.executable, "-m", "pagedserve.kernels.cpu.bench", *sys.argv[1:]])


def main() -> None:
    _run_with_engine_spin()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "bfloat16", "float16", "int8"],
                        help="KV cache element type (int8: --long only)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--long", action="store_true", help="the native kernel at long contexts")
    parser.add_argument("--level", default=None, help="native build level (--long; default: "
                        "the best this CPU runs)")
    parser.add_argument("--against", default=None, metavar="LIB.so",
                        help="--long: also time every case with this build of the native "
                        "library, in turn with this tree's")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the calling thread's CPU time (--long, with --threads 1)")
    args = parser.parse_args()
    if args.dtype == "int8" and not args.long:
        parser.error("--dtype int8 is timed with --long only")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)
    if args.long:
        from pagedserve.kernels.cpu import native as cpu_native

        log.info("%s", _omp_wait())
        level = args.level or cpu_native.runnable_levels()[-1]
        bench_long(level, dtype, args.iters, args.cpu_time, against=args.against)
        bench_layers(level, dtype, args.iters, against=args.against)
        bench_layers(level, dtype, args.iters, contexts=_batch_contexts(), against=args.against)
        return
    shapes = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    ctx = _batch_contexts()
    log.info("SmolLM2-135M shapes (Hq 9, Hkv 3, D 64, block 16), %s, %d threads, %s",
             args.dtype, torch.get_num_threads(), _omp_wait())  # fmt: skip
    bench_step("64 decodes, ctx 100-400", make_step(ctx, [1] * 64, **shapes), args.iters)
    seq = ctx[:30] + [256, 512]
    q = [1] * 30 + [256, 256]
    bench_step("30 decodes + 2 prefill chunks of 256", make_step(seq, q, **shapes), args.iters)


if __name__ == "__main__":
    main()
