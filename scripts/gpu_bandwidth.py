"""The decode-attention bandwidth part of ``scripts/gpu_check.py``: the Triton paged
decode kernel's K/V read bandwidth against the H200's datasheet peak and a measured
device copy (``--device cpu``: a tiny case in the Triton interpreter, a check of the
script, not a measurement)."""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable

H200_PEAK_TBS = 4.8
"""HBM3e bandwidth of the H200 by its datasheet, TB/s."""

BW_CASES = [
    # (batch, context, Hq, Hkv, head_dim, block_size)
    (64, 4096, 32, 8, 128, 16),
    (256, 1024, 32, 8, 128, 16),
    (8, 32768, 32, 8, 128, 16),
    (128, 2048, 9, 3, 64, 16),
]
CPU_CASES = [(2, 80, 4, 2, 32, 16)]


def _paged_case(batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype, device: str,
                seed: int = 0):  # fmt: skip
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    nb_per = -(-ctx // bs)
    num_blocks = batch * nb_per + 1
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    tables = perm.view(batch, nb_per).to(torch.int32)
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=device).to(dtype)
    v = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=device).to(dtype)
    q = torch.randn(batch, hq, d, generator=gen, device=device).to(dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, k, v, tables, seq_lens


def _copy_bandwidth(device: str) -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (TB/s)."""
    import torch
    from triton.testing import do_bench

    n = 2**30 // 2
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)

    def copy() -> None:
        b.copy_(a)

    ms = do_bench(copy, warmup=5, rep=50, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3) / 1e12


def cmd_bandwidth(args: argparse.Namespace, before_cuda: Callable, emit: Callable) -> int:
    """The kernel against the torch reference on a reduced case, then each case's read
    bandwidth (``before_cuda`` and ``emit``: ``gpu_check``'s dry-run stop and summary)."""
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from pagedserve.kernels import torch_ref
    from pagedserve.kernels.triton.decode import (
        choose_num_splits,
        device_num_sms,
        paged_decode_attention,
    )

    device = args.device
    dtype = getattr(torch, args.dtype if device == "cuda" else "float32")
    cases = BW_CASES if device == "cuda" else CPU_CASES
    failed = 0
    before_cuda(args, f"{len(cases)} {str(dtype)[6:]} decode cases on {device}")
    # Correctness of the measured kernel on a reduced case first.
    q, k, v, bt, sl = _paged_case(3, 700, 8, 2, 64, 16, dtype, device)
    sl = torch.tensor([700, 33, 512], dtype=torch.int32, device=device)
    scale = 64**-0.5
    ref = torch_ref.paged_decode_attention(q, k, v, bt, sl, scale)
    out = paged_decode_attention(q, k, v, bt, sl, scale, max_seq_len=700)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    ok = torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)
    failed += not ok
    emit(args.summary, f"bandwidth: kernel vs torch reference {'PASS' if ok else 'FAIL'} "
                       f"(max err {(out.float() - ref.float()).abs().max().item():.2e})")  # fmt: skip
    if device == "cuda":
        copy_tbs = _copy_bandwidth(device)
        emit(args.summary, f"bandwidth: device copy {copy_tbs:.2f} TB/s "
                           f"({100 * copy_tbs / H200_PEAK_TBS:.0f}% of {H200_PEAK_TBS} TB/s)")  # fmt: skip
    for batch, ctx, hq, hkv, d, bs in cases:
        q, k, v, bt, sl = _paged_case(batch, ctx, hq, hkv, d, bs, dtype, device)
        out = torch.empty_like(q)
        splits = choose_num_splits(batch, hkv, ctx, device_num_sms(torch.device(device)))

        def run(q=q, k=k, v=v, bt=bt, sl=sl, out=out, ctx=ctx, d=d) -> None:
            paged_decode_attention(q, k, v, bt, sl, d**-0.5, max_seq_len=ctx, out=out)

        if device == "cuda":
            from triton.testing import do_bench

            ms = do_bench(run, warmup=25, rep=100, return_mode="median")
        else:
            run()
            t0 = time.perf_counter()
            run()
            ms = 1e3 * (time.perf_counter() - t0)
        elem = q.element_size()
        kv_bytes = batch * ctx * hkv * d * 2 * elem
        other = 2 * q.numel() * elem + bt.numel() * 4 + sl.numel() * 4
        tbs = (kv_bytes + other) / (ms * 1e-3) / 1e12
        what = (f"{100 * tbs / H200_PEAK_TBS:5.1f}% of {H200_PEAK_TBS} TB/s"
                if device == "cuda" else "interpreted: not a measurement")  # fmt: skip
        emit(args.summary,
             f"bandwidth: B={batch:3d} ctx={ctx:5d} Hq/Hkv={hq}/{hkv} D={d} {str(dtype)[6:]} "
             f"splits={splits:2d}: {ms * 1e3:8.1f} us, "
             f"{kv_bytes / 2**20:7.1f} MiB K/V, {tbs:.3f} TB/s ({what})")  # fmt: skip
        del q, k, v, bt, sl, out
        gc.collect()
    return 1 if failed else 0
