"""Q4_K, Q5_K and Q6_K encoders in numpy, for GGUF files made here (:mod:`.gguf_requant`).

The ``gguf`` package dequantizes the K-quants but has no quantizer for them. These
functions compute what llama.cpp's ``quantize_row_q4_K_ref``, ``quantize_row_q5_K_ref``
and ``quantize_row_q6_K_ref`` compute (the encoders ``llama-quantize`` runs without an
importance matrix), for every block of an array at once: per 32-weight sub-block a
weighted least-squares search over 21 (Q4_K) or 16 (Q5_K) candidate scales and offsets
(``make_qkx2_quants``), per 16-weight sub-block of Q6_K a search over 19 scales
(``make_qx_quants``), then the sub-block scales rounded to 6 (8) bits under one float16
super-block scale and the weights rounded again under the rounded scales. The arithmetic
is float32 in the reference's order (sums run over a sub-block's weights in turn), so the
bytes are llama.cpp's. Layouts, one super-block of 256 weights:

- Q4_K (144 bytes): ``d``, ``dmin`` (float16), 12 bytes of eight 6-bit scales and mins,
  128 bytes of 4-bit codes (byte ``32*i + l`` holds weights ``64*i + l`` and ``64*i + 32 + l``);
  a weight is ``d * scale * q - dmin * min``.
- Q5_K (176 bytes): as Q4_K, with 32 bytes ``qh`` between scales and codes: bit ``j`` of
  byte ``l`` is the fifth bit of weight ``32*j + l``.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales,
  ``d`` (float16); a weight is ``d * scale * (q - 32)``.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
"""Weights per super-block."""
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
"""Bytes per super-block of each type."""

_F32 = np.float32


def quantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """``data`` (``[..., k]``, ``k`` a multiple of 256) in ``qtype`` (``Q4_K``, ``Q5_K`` or
    ``Q6_K``): uint8 ``[..., k / 256 * block bytes]``, the shape ``gguf.quants.quantize``
    gives."""
    qtype = qtype.upper()
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"{qtype!r}: expected one of {', '.join(BLOCK_BYTES)}")
    k = data.shape[-1]
    if k % QK_K:
        raise ValueError(f"{qtype} needs rows of whole {QK_K}-weight blocks, got {k}")
    blocks = np.asarray(data, dtype=_F32).reshape(-1, QK_K)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = _q6_k(blocks) if qtype == "Q6_K" else _q45_k(blocks, 15 if qtype == "Q4_K" else 31)
    return out.reshape(*data.shape[:-1], k // QK_K * BLOCK_BYTES[qtype])


def _rint(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``nearest_int`` (ties to even) clamped to ``[lo, hi]``, kept as float32."""
    return np.clip(np.rint(v), lo, hi)


def _qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """``make_qkx2_quants`` on every column of ``x`` (``[n, groups]``, weights ``w``):
    the scales, the mins (subtracted) and the codes ``[n, groups]``."""
    mn = np.minimum(x.min(axis=0), _F32(0))
    mx = x.max(axis=0)
    flat = mx == mn
    sum_w = w.sum(axis=0)  # axis 0: each column summed in order, as the reference does
    sum_x = (w * x).sum(axis=0)
    span = np.where(flat, _F32(1), mx - mn)
    iscale = _F32(nmax) / span
    scale = _F32(1) / iscale
    q = _rint(iscale * (x - mn), 0, nmax)
    diff = scale * q + mn - x
    best = (w * (diff * diff)).sum(axis=0)
    for step in range(nstep + 1):
        span = np.where(flat, _F32(1), mx - mn)
        iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / span
        qa = _rint(iscale * (x - mn), 0, nmax)
        wq = w * qa
        sum_l, sum_l2, sum_xl = wq.sum(axis=0), (wq * qa).sum(axis=0), (wq * x).sum(axis=0)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        this_min = np.where(positive, _F32(0), this_min)
        diff = this_scale * qa + this_min - x
        err = (w * (diff * diff)).sum(axis=0)
        better = (det > 0) & (err < best)
        q = np.where(better, qa, q)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    return np.where(flat, _F32(0), scale), -mn, np.where(flat, _F32(0), q)


def _q45_k(x: np.ndarray, nmax: int) -> np.ndarray:
    """Q4_K (``nmax`` 15) or Q5_K (31) blocks of ``x`` ``[nb, 256]``."""
    nb = len(x)
    cols = np.ascontiguousarray(x.reshape(nb * 8, 32).T)  # [32, sub-blocks]
    av_x = np.sqrt((cols * cols).sum(axis=0) / _F32(32))
    w = av_x + np.abs(cols)
    if nmax == 15:
        scales, mins, q = _qkx2(cols, w, 15, -1.0, 0.1, 20)
    else:
        scales, mins, q = _qkx2(cols, w, 31, -0.5, 0.1, 15)
    scales, mins, q = scales.reshape(nb, 8), mins.reshape(nb, 8), q.T.reshape(nb, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))[:, None]
    inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))[:, None]
    # uint8_t ls = nearest_int(...): wraps modulo 256, then MIN(63, ls)
    ls = np.minimum(np.rint(inv_scale * scales).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_min * mins).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    d = (max_scale / _F32(63)).astype(np.float16)
    dmin = (max_min / _F32(63)).astype(np.float16)
    sub_d = (d.astype(_F32)[:, None] * ls.astype(_F32))[..., None]
    sub_m = (dmin.astype(_F32)[:, None] * lm.astype(_F32))[..., None]
    requant = _rint((x.reshape(nb, 8, 32) + sub_m) / sub_d, 0, nmax)
    q = np.where(sub_d != 0, requant, q).astype(np.uint8).reshape(nb, 4, 2, 32)
    packed_scales = np.concatenate(
        [ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
         (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=1)  # fmt: skip
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(nb, 128)
    parts = [d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8), packed_scales]
    if nmax == 31:
        high = (q.reshape(nb, 8, 32) >> 4).astype(np.uint8)
        parts.append(np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[:, None], axis=1))
    return np.concatenate([*parts, qs], axis=1)


def _qx(x: np.ndarray, nmax: int):
    """``make_qx_quants`` (``rmse_type`` 1, no importance) on every column of ``x``
    ``[n, groups]``: the scales and the codes (offset by ``nmax``)."""
    ax = np.abs(x)
    at = ax.argmax(axis=0)
    amax = np.take_along_axis(ax, at[None], axis=0)[0]
    top = np.take_along_axis(x, at[None], axis=0)[0]
    zero = amax < _F32(1e-15)
    top = np.where(zero, _F32(1), top)
    w = x * x
    wx = w * x

    def fit(iscale):
        lv = _rint(iscale * x, -nmax, nmax - 1)
        return lv, (wx * lv).sum(axis=0), (w * lv * lv).sum(axis=0)

    lv, sumlx, suml2 = fit(_F32(-nmax) / top)
    q = lv + nmax
    scale = np.where(suml2 != 0, sumlx / suml2, _F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step:
            lv, sumlx, suml2 = fit(-(_F32(nmax) + _F32(0.1) * _F32(step)) / top)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            q = np.where(better, lv + nmax, q)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, _F32(0), scale), np.where(zero, _F32(0), q)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``x`` ``[nb, 256]``."""
    nb = len(x)
    scales, q = _qx(np.ascontiguousarray(x.reshape(nb * 16, 16).T), 32)
    scales, q = scales.reshape(nb, 16), q.T.reshape(nb, 16, 16)
    at = np.abs(scales).argmax(axis=1)
    top = np.take_along_axis(scales, at[:, None], axis=1)[:, 0]
    empty = np.abs(top) < _F32(1e-15)
    iscale = np.where(empty, _F32(0), _F32(-128) / np.where(empty, _F32(1), top))
    d = np.where(empty, _F32(0), _F32(1) / iscale).astype(np.float16)
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int64) & 0xFF
    sc = sc.astype(np.uint8).view(np.int8)
    sub_d = (d.astype(_F32)[:, None] * sc.astype(_F32))[..., None]
    requant = _rint(x.reshape(nb, 16, 16) / sub_d, -32, 31) + 32
    q = np.where(sub_d != 0, requant, q).astype(np.uint8).reshape(nb, 2, 4, 32)
    q = np.where(empty[:, None, None, None], np.uint8(0), q)
    sc = np.where(empty[:, None], np.int8(0), sc)
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)  # fmt: skip
    qh = np.bitwise_or.reduce((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None], axis=2)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8),
                           d.reshape(nb, 1).view(np.uint8)], axis=1)  # fmt: skip
