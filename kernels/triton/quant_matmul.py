"""Triton matmul over weight-only quantized weights, dequantized in registers.

``y = x @ W^T (+ bias)`` for float ``x [M, K]`` and a :class:`~pagedserve.kernels.quant.QuantizedWeight`
``W [N, K]`` in ``q8_0``, ``q4_0``, ``q4_1`` or ``int8``, read from its planes as stored
(codes, per-block float16 scales and offsets, or per-row float32 scales). A program owns
a ``BLOCK_M x BLOCK_N`` tile of ``y`` and walks K one 32-weight block at a time. A
4-bit block's 16 bytes hold its elements 0-15 in the low nibbles and 16-31 in the high
ones (GGML's order), so the two halves are multiplied with the matching halves of
``x`` (two ``tl.dot`` of K = 16) instead of being interleaved. Each weight is
dequantized as GGML does (``d * q``, then ``+ m``); products accumulate in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant import QK, QuantizedWeight

FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "int8": 3}
BLOCK_M = 16
BLOCK_N = 64


@triton.jit(do_not_specialize=["M"])  # the step's row count: one variant for all
def _quant_matmul_kernel(
    x_ptr, qs_ptr, d_ptr, m_ptr, scale_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_dn, stride_ym,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    half = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    q_rows = qs_ptr + offs_n[None, :].to(tl.int64) * stride_qn
    num_blocks = K // 32
    for b in range(0, num_blocks):
        k0 = b * 32
        x_lo = tl.load(x_rows + (k0 + half)[None, :], mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_rows + (k0 + 16 + half)[None, :], mask=m_mask[:, None], other=0.0)
        x_lo = x_lo.to(tl.float32)
        x_hi = x_hi.to(tl.float32)
        if FMT == 0 or FMT == 3:  # q8_0 / int8: one signed byte a weight
            w_lo = tl.load(q_rows + (k0 + half)[:, None], mask=n_mask[None, :], other=0)
            w_hi = tl.load(q_rows + (k0 + 16 + half)[:, None], mask=n_mask[None, :], other=0)
            w_lo = w_lo.to(tl.float32)
            w_hi = w_hi.to(tl.float32)
        else:  # q4_0 / q4_1: 16 bytes, low nibbles then high nibbles
            byte = tl.load(q_rows + (b * 16 + half)[:, None], mask=n_mask[None, :], other=0)
            byte = byte.to(tl.int32) & 0xFF
            w_lo = (byte & 0x0F).to(tl.float32)
            w_hi = (byte >> 4).to(tl.float32)
            if FMT == 1:
                w_lo = w_lo - 8.0
                w_hi = w_hi - 8.0
        if FMT != 3:
            d = tl.load(d_ptr + offs_n.to(tl.int64) * stride_dn + b, mask=n_mask, other=0.0)
            d = d.to(tl.float32)[None, :]
            w_lo = w_lo * d
            w_hi = w_hi * d
            if FMT == 2:
                mo = tl.load(m_ptr + offs_n.to(tl.int64) * stride_dn + b, mask=n_mask, other=0.0)
                mo = mo.to(tl.float32)[None, :]
                w_lo = w_lo + mo
                w_hi = w_hi + mo
        acc += tl.dot(x_lo, w_lo, input_precision="ieee")
        acc += tl.dot(x_hi, w_hi, input_precision="ieee")
    if FMT == 3:
        s = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
        acc = acc * s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def quant_matmul(x: torch.Tensor, weight: QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight^T (+ bias)`` in ``x``'s dtype (``K`` a multiple of 32)."""
    if x.dim() != 2 or x.shape[1] != weight.k:
        raise ValueError(f"x {tuple(x.shape)} does not match a [{weight.n}, {weight.k}] weight")
    if weight.k % QK:
        raise ValueError(f"the Triton quantized matmul needs K a multiple of {QK}, "
                         f"got {weight.k}")
    if weight.fmt not in FORMAT_CODES:
        raise ValueError(f"the Triton quantized matmul does not take {weight.fmt} weights "
                         f"(it takes {', '.join(FORMAT_CODES)})")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n, k = x.shape[0], weight.n, weight.k
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fmt = FORMAT_CODES[weight.fmt]
    d = weight.d
    dummy = weight.qs
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _quant_matmul_kernel[grid](
        x, weight.qs, d if fmt != 3 else dummy, weight.m if weight.m is not None else dummy,
        d if fmt == 3 else dummy, bias if bias is not None else dummy, y,
        m, n, k, x.stride(0), weight.qs.stride(0), 0 if fmt == 3 else d.stride(0), y.stride(0),
        FMT=fmt, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return y
