"""The quantized linears with float and 8-bit activations: ``python -m
pagedserve.loadtest.qgemm_bench``.

Each linear runs as the layer ops run it (the native product up to the row limit, the
dequantized weight's float product above), with float and with 8-bit activations in turn:
every GGUF format kept quantized (random weights encoded by gguf's encoders and
:mod:`pagedserve.loadtest.kquants`), on the default model's three shapes of linear, at 1-512
rows; the best of ``--iters`` in milliseconds and the ratio int8 / float.
``--vs-dequantized``: the 8-bit products against the dequantized weight's float product
at 128-1,024 rows, where the row limits by format come from. ``--vnni-vs-maddubs``: the
8-bit products with VNNI's integer dots against AVX2's maddubs on a CPU that has both
(their outputs checked equal bit for bit). Run it with
``GOMP_SPINCOUNT=1000`` (as the engine runs) so torch's idle OpenMP thread does not hold
the second core.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import torch

from pagedserve.kernels.cpu.bench import _omp_wait, _time_ms

log = logging.getLogger("pagedserve.loadtest.qgemm_bench")

QGEMM_SHAPES = ((1536, 576), (576, 1536), (576, 576))
"""(n, k) of the default model's linears: gate/up, down, q/o."""
QGEMM_ROWS = (1, 8, 32, 64, 128, 512)


def _random_quantized(fmt: str, n: int, k: int, g: torch.Generator):
    """A normal random ``[n, k]`` matrix encoded in ``fmt`` as a GGUF file stores it
    (``gguf``'s encoders; the K-quants' from :mod:`pagedserve.loadtest.kquants`)."""
    import gguf

    from pagedserve.engine.loader.gguf_weights import quantized_from_blocks
    from pagedserve.loadtest import kquants

    x = (torch.randn(n, k, generator=g) * 0.02).numpy()
    if fmt.upper() in kquants.BLOCK_BYTES:
        raw = kquants.quantize(x, fmt)
    else:
        raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType[fmt.upper()])
    return quantized_from_blocks(fmt, raw, k)


def _weights(formats: Sequence[str], shapes: Sequence[tuple[int, int]], g: torch.Generator):
    """``(fmt, n, k, weight)`` for each format and shape whose k its blocks divide (the
    K-quants' 256-weight blocks skip a k of 576)."""
    from pagedserve.kernels.quant import BLOCK_WEIGHTS

    for fmt in formats:
        for n, k in shapes:
            if not k % BLOCK_WEIGHTS.get(fmt, 32):
                yield fmt, n, k, _random_quantized(fmt, n, k, g)


def bench_qgemm(level: str, iters: int, rows: Sequence[int] = QGEMM_ROWS,
                shapes: Sequence[tuple[int, int]] = QGEMM_SHAPES, dots: str = "auto") -> None:
    """The quantized linears with float and 8-bit activations (see the module)."""
    from pagedserve.kernels.cpu import native as cpu_native
    from pagedserve.kernels.cpu.layer_ops import NativeLayerOps
    from pagedserve.kernels.quant import FORMATS

    lib = cpu_native.build_library(level)
    ops = {a: NativeLayerOps(lib, quantized_activations=a, int8_dots=dots)
           for a in ("float", "int8")}  # fmt: skip
    log.info("quantized linears, build level %s (%s dots), %d threads, %s; ms, best of %d",
             level, ops["int8"].int8_dots, torch.get_num_threads(), _omp_wait(), iters)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for fmt, n, k, w in _weights([f for f in FORMATS if f != "int8"], shapes, g):
        cells = []
        for m in rows:
            x = torch.randn(m, k, generator=g)
            t = {a: _time_ms(lambda o=o, x=x, w=w: o.linear(x, w), iters) for a, o in ops.items()}
            cells.append(f"{m}: {t['float']:.3f}/{t['int8']:.3f} ({t['int8'] / t['float']:.2f})")
        log.info("%-5s [%4d, %4d]  rows: float/int8 ms (ratio)  %s", fmt, n, k, "  ".join(cells))


LIMIT_ROWS = (128, 192, 256, 512, 1024)


def bench_limits(level: str, iters: int, rows: Sequence[int] = LIMIT_ROWS,
                 shapes: Sequence[tuple[int, int]] = QGEMM_SHAPES, dots: str = "auto") -> None:
    """Where the 8-bit-activation product stops paying: for every format that has one, the
    integer product in registers (whatever the row limit) against the dequantized weight's
    float product (what runs past the limit), in turn, best of ``iters`` (3 rounds)."""
    from pagedserve.kernels.cpu import native as cpu_native
    from pagedserve.kernels.cpu.layer_ops import NativeLayerOps
    from pagedserve.kernels.cpu.quant import INT8_ACTIVATION_FORMATS

    lib = cpu_native.build_library(level)
    direct, dequant = (NativeLayerOps(lib, quantized_activations="int8", int8_dots=dots,
                                      quant_max_rows=most) for most in (1 << 30, 0))  # fmt: skip
    log.info("8-bit products against the dequantized weight's, build level %s (%s dots), %d "
             "threads, %s; ms, best of %d", level, direct.int8_dots, torch.get_num_threads(),
             _omp_wait(), 3 * iters)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for fmt, n, k, w in _weights(INT8_ACTIVATION_FORMATS, shapes, g):
        cells = []
        for m in rows:
            x = torch.randn(m, k, generator=g)
            t = {"int8": float("inf"), "dequant": float("inf")}
            for _ in range(3):  # in turn: a shared host's drift hits both
                for name, o in (("int8", direct), ("dequant", dequant)):
                    t[name] = min(t[name], _time_ms(lambda o=o, x=x, w=w: o.linear(x, w), iters))
            cells.append(f"{m}: {t['int8']:.3f}/{t['dequant']:.3f} "
                         f"({t['int8'] / t['dequant']:.2f})")
        log.info("%-5s [%4d, %4d]  rows: int8/dequantized ms (ratio)  %s", fmt, n, k,
                 "  ".join(cells))


DOTS_ROWS = (1, 4, 8, 32, 64, 128)


def bench_dots(level: str, iters: int, rows: Sequence[int] = DOTS_ROWS,
               shapes: Sequence[tuple[int, int]] = QGEMM_SHAPES,
               kinds: tuple[str, str] = ("vnni", "maddubs")) -> None:
    """The 8-bit products with one kind of integer dot against another (default VNNI's
    against maddubs'), in turn, best of ``iters`` (3 rounds), every output compared bit
    for bit; a ValueError where this build or CPU lacks either."""
    from pagedserve.kernels.cpu import native as cpu_native
    from pagedserve.kernels.cpu.layer_ops import NativeLayerOps
    from pagedserve.kernels.cpu.quant import INT8_ACTIVATION_FORMATS

    lib = cpu_native.build_library(level)
    ops = NativeLayerOps(lib, quantized_activations="int8", quant_max_rows=1 << 30)
    before = cpu_native.int8_dots(lib)
    a, b = kinds
    for dots in kinds:
        cpu_native.use_int8_dots(lib, dots)  # the ValueError before any timing
    log.info("8-bit products, %s dots against %s, build level %s, %d threads, %s; ms, best "
             "of %d", a, b, level, torch.get_num_threads(), _omp_wait(), 3 * iters)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    try:
        for fmt, n, k, w in _weights(INT8_ACTIVATION_FORMATS, shapes, g):
            cells = []
            for m in rows:
                x = torch.randn(m, k, generator=g)
                t, out = {a: float("inf"), b: float("inf")}, {}
                for _ in range(3):  # in turn: a shared host's drift hits both
                    for dots in t:
                        cpu_native.use_int8_dots(lib, dots)
                        out[dots] = ops.linear(x, w)
                        t[dots] = min(t[dots], _time_ms(lambda x=x, w=w: ops.linear(x, w), iters))
                if not torch.equal(out[a], out[b]):
                    raise AssertionError(f"{fmt} [{n}, {k}] at {m} rows: {a} and {b} outputs "
                                         f"differ")
                cells.append(f"{m}: {t[a]:.3f}/{t[b]:.3f} ({t[a] / t[b]:.2f})")
            log.info("%-5s [%4d, %4d]  rows: %s/%s ms (ratio)  %s", fmt, n, k, a, b,
                     "  ".join(cells))
    finally:
        cpu_native.use_int8_dots(lib, before or "auto")


def main(argv: list[str] | None = None) -> int:
    from pagedserve.kernels.cpu import native as cpu_native

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--level", default=None, help="native build level (default: the best "
                        "this CPU runs)")
    parser.add_argument("--vs-dequantized", action="store_true",
                        help="the 8-bit products against the dequantized weight's float "
                             "product at 128-1,024 rows (where the row limits come from)")
    parser.add_argument("--vnni-vs-maddubs", action="store_true",
                        help="the 8-bit products with VNNI's integer dots against maddubs' "
                             "(outputs checked equal bit for bit)")
    parser.add_argument("--dots", default="vnni,maddubs",
                        help="with --vnni-vs-maddubs: the two kinds of dot compared "
                             "(e.g. vnni512,vnni)")
    parser.add_argument("--int8-dots", default="auto", choices=("auto", "vnni512", "vnni", "maddubs"),
                        help="the integer dots of the 8-bit products (default: VNNI where "
                             "the CPU has it)")
    parser.add_argument("--rows", default=None,
                        help="comma-separated row counts (default: each mode's own)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    level = args.level or cpu_native.runnable_levels()[-1]
    rows = {} if args.rows is None else {"rows": [int(r) for r in args.rows.split(",")]}
    if args.vnni_vs_maddubs:
        a, _, b = args.dots.partition(",")
        bench_dots(level, args.iters, kinds=(a, b), **rows)
    elif args.vs_dequantized:
        bench_limits(level, args.iters, dots=args.int8_dots, **rows)
    else:
        bench_qgemm(level, args.iters, dots=args.int8_dots, **rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
