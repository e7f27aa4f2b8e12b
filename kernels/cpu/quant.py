"""The native library's products of weight-only quantized matrices.

:func:`native_linear` multiplies float32 rows by a :class:`~kernels.quant.QuantizedWeight`
dequantizing in registers (``csrc/qgemm_cpu.c``); :func:`native_dequantize` expands a
weight, or some of its rows, to float32. Both take the weight's planes as they are; the
format codes are those of ``csrc/abi.h``.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu.abi import QUANT_FORMATS
from kernels.quant import QuantizedWeight


def format_code(weight: QuantizedWeight) -> int:
    """The native library's code of ``weight``'s format."""
    return QUANT_FORMATS[weight.fmt]


def _planes(weight: QuantizedWeight) -> tuple[int | None, int | None, int | None]:
    """Pointers to (d, m, scale) as the C functions take them."""
    if weight.fmt == "int8":
        return None, None, weight.d.data_ptr()
    return weight.d.data_ptr(), None if weight.m is None else weight.m.data_ptr(), None


def native_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantizedWeight,
                  bias: torch.Tensor | None, num_threads: int) -> torch.Tensor:
    """The native product of float32 CPU ``x`` ``[rows, k]`` (unit column stride) and
    ``weight`` (contiguous planes), plus ``bias`` (float32 ``[n]``)."""
    rows = x.shape[0]
    out = x.new_empty(rows, weight.n)
    d, m, scale = _planes(weight)
    status = lib.qgemm(format_code(weight), x.data_ptr(), x.stride(0), rows, weight.k,
                       weight.qs.data_ptr(), d, m, scale, weight.n,
                       None if bias is None else bias.data_ptr(), out.data_ptr(), weight.n,
                       num_threads)  # fmt: skip
    if status != 0:
        raise ValueError(f"qgemm refused a {weight.fmt} [{weight.n}, {weight.k}] weight")
    return out


def native_dequantize(lib: ctypes.CDLL, weight: QuantizedWeight, num_threads: int,
                      rows: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[n, k]`` (or rows ``rows``, int64) dequantized by the native library."""
    index = None if rows is None else rows.to(torch.int64).contiguous()
    count = weight.n if index is None else index.numel()
    if out is None:
        out = torch.empty(count, weight.k, dtype=torch.float32)
    d, m, scale = _planes(weight)
    status = lib.qdequant(format_code(weight), weight.qs.data_ptr(), d, m, scale, weight.k,
                          None if index is None else index.data_ptr(), count, out.data_ptr(),
                          num_threads)  # fmt: skip
    if status != 0:
        raise ValueError(f"qdequant refused a {weight.fmt} [{weight.n}, {weight.k}] weight")
    return out
