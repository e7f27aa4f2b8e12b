"""Triton matmul over weight-only quantized weights, dequantized in registers.

``y = x @ W^T (+ bias)`` for float ``x [M, K]`` and a :class:`~pagedserve.kernels.quant.QuantizedWeight`
``W [N, K]`` in ``q8_0``, ``q4_0``, ``q4_1`` or ``int8``, read from its planes as stored
(codes, per-block float16 scales and offsets, or per-row float32 scales). A program owns
a ``BLOCK_M x BLOCK_N`` tile of ``y`` and walks K one 32-weight block at a time. A
4-bit block's 16 bytes hold its elements 0-15 in the low nibbles and 16-31 in the high
ones (GGML's order), so the two halves are multiplied with the matching halves of
``x`` (two ``tl.dot`` of K = 16) instead of being interleaved. Each weight is
dequantized as GGML does (``d * q``, then ``+ m``); products accumulate in float32.

The block formats (``q5_0``, ``q5_1`` and the K-quants ``q4_k``, ``q5_k``, ``q6_k``) are read
from their one plane, the GGUF file's blocks as they are (:func:`_block_matmul_kernel`):
a program walks K one 32-weight run at a time (a Q5 block, or a K-quant's sub-block or
pair of Q6_K's 16-weight sub-blocks), picks each weight's bits out of its block's bytes
as ``gguf``'s dequantizer does (the K-quants' 6-bit sub-block scales and mins included)
and multiplies the float32 run with one ``tl.dot``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant import BLOCK_BYTES, BLOCK_WEIGHTS, QK, QuantizedWeight

FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "int8": 3}
BLOCK_FORMAT_CODES = {"q5_0": 0, "q5_1": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4}
BLOCK_M = 16
BLOCK_N = 64


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile: its rows and columns, and which of them exist."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _store_tile(acc, bias_ptr, y_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """The float32 tile ``acc`` plus the bias (where there is one) into ``y``."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])  # the step's row count: one variant for all
def _quant_matmul_kernel(
    x_ptr, qs_ptr, d_ptr, m_ptr, scale_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_dn, stride_ym,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, m_mask, n_mask = _tile(M, N, BLOCK_M, BLOCK_N)
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
    _store_tile(acc, bias_ptr, y_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask, HAS_BIAS)


@triton.jit
def _f16_at(p, mask):
    """float32 of the little-endian float16 at byte pointers ``p``."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _block_matmul_kernel(
    x_ptr, qs_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_ym,
    FMT: tl.constexpr, BW: tl.constexpr, BB: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, m_mask, n_mask = _tile(M, N, BLOCK_M, BLOCK_N)
    i = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    q_rows = qs_ptr + offs_n.to(tl.int64) * stride_qn
    w_mask = n_mask[None, :]
    for b in range(0, K // 32):
        k0 = b * 32
        xs = tl.load(x_rows + (k0 + i)[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        blk = q_rows + (k0 // BW) * BB  # [BLOCK_N] pointers to each row's block
        s = (k0 % BW) // 32  # the run's place in its block
        if FMT == 0 or FMT == 1:  # q5_0 {d; qh[4]; qs[16]}, q5_1 {d, m; qh[4]; qs[16]}
            qh_at = 2 if FMT == 0 else 4
            byte = tl.load(blk[None, :] + (qh_at + 4 + i % 16)[:, None], mask=w_mask, other=0)
            nib = (byte.to(tl.int32) >> (4 * (i // 16))[:, None]) & 0x0F
            hb = tl.load(blk[None, :] + (qh_at + i // 8)[:, None], mask=w_mask, other=0)
            q = nib | (((hb.to(tl.int32) >> (i % 8)[:, None]) & 1) << 4)
            d = _f16_at(blk, n_mask)[None, :]
            if FMT == 0:
                w = d * (q - 16).to(tl.float32)
            else:
                w = d * q.to(tl.float32) + _f16_at(blk + 2, n_mask)[None, :]
        elif FMT == 2 or FMT == 3:  # q4_k, q5_k {d, dmin; scales[12]; (qh[32];) qs[128]}
            j = s % 4
            a = tl.load(blk + 4 + j, mask=n_mask, other=0).to(tl.int32)
            c = tl.load(blk + 8 + j, mask=n_mask, other=0).to(tl.int32)
            e = tl.load(blk + 12 + j, mask=n_mask, other=0).to(tl.int32)
            sc = tl.where(s < 4, a & 63, (e & 0x0F) | ((a >> 6) << 4))
            mn = tl.where(s < 4, c & 63, (e >> 4) | ((c >> 6) << 4))
            d1 = _f16_at(blk, n_mask) * sc.to(tl.float32)
            m1 = _f16_at(blk + 2, n_mask) * mn.to(tl.float32)
            qs_at = 16 if FMT == 2 else 48
            byte = tl.load(blk[None, :] + (qs_at + 32 * (s // 2) + i)[:, None], mask=w_mask,
                           other=0)  # fmt: skip
            q = (byte.to(tl.int32) >> (4 * (s % 2))) & 0x0F
            if FMT == 3:
                hb = tl.load(blk[None, :] + (16 + i)[:, None], mask=w_mask, other=0)
                q = q | (((hb.to(tl.int32) >> s) & 1) << 4)
            w = d1[None, :] * q.to(tl.float32) - m1[None, :]
        else:  # q6_k {ql[128]; qh[64]; i8 scales[16]; d}: weights 128h + 32t + i
            h = s // 4
            t = s % 4
            lo = tl.load(blk[None, :] + (64 * h + 32 * (t % 2) + i)[:, None], mask=w_mask,
                         other=0)  # fmt: skip
            hi = tl.load(blk[None, :] + (128 + 32 * h + i)[:, None], mask=w_mask, other=0)
            q = (((lo.to(tl.int32) >> (4 * (t // 2))) & 0x0F)
                 | (((hi.to(tl.int32) >> (2 * t)) & 3) << 4))  # fmt: skip
            sc = tl.load(blk[None, :] + (192 + 8 * h + 2 * t + i // 16)[:, None], mask=w_mask,
                         other=0)  # fmt: skip
            a = _f16_at(blk + 208, n_mask)[None, :] * sc.to(tl.int8, bitcast=True).to(tl.float32)
            w = a * (q - 32).to(tl.float32)
        acc += tl.dot(xs, w, input_precision="ieee")
    _store_tile(acc, bias_ptr, y_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask, HAS_BIAS)


def quant_matmul(x: torch.Tensor, weight: QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight^T (+ bias)`` in ``x``'s dtype (``K`` a multiple of 32; of 256
    for the K-quants, as their weights are)."""
    if x.dim() != 2 or x.shape[1] != weight.k:
        raise ValueError(f"x {tuple(x.shape)} does not match a [{weight.n}, {weight.k}] weight")
    if weight.k % QK:
        raise ValueError(f"the Triton quantized matmul needs K a multiple of {QK}, "
                         f"got {weight.k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n, k = x.shape[0], weight.n, weight.k
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    if weight.fmt in BLOCK_FORMAT_CODES:
        _block_matmul_kernel[grid](
            x, weight.qs, bias if bias is not None else weight.qs, y,
            m, n, k, x.stride(0), weight.qs.stride(0), y.stride(0),
            FMT=BLOCK_FORMAT_CODES[weight.fmt], BW=BLOCK_WEIGHTS[weight.fmt],
            BB=BLOCK_BYTES[weight.fmt], HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
        )  # fmt: skip
        return y
    fmt = FORMAT_CODES[weight.fmt]
    d = weight.d
    dummy = weight.qs
    _quant_matmul_kernel[grid](
        x, weight.qs, d if fmt != 3 else dummy, weight.m if weight.m is not None else dummy,
        d if fmt == 3 else dummy, bias if bias is not None else dummy, y,
        m, n, k, x.stride(0), weight.qs.stride(0), 0 if fmt == 3 else d.stride(0), y.stride(0),
        FMT=fmt, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return y
