"""The native library's products of weight-only quantized matrices.

:func:`native_linear` multiplies float32 rows by a :class:`~pagedserve.kernels.quant.QuantizedWeight`
dequantizing in registers (``csrc/qgemm_cpu.c``); :func:`native_dequantize` expands a
weight, or some of its rows, to float32, from the weight's planes or from its packed copy
(:func:`native_pack`), bit for bit the same. The format codes are those of
``csrc/abi.h``; a code with ``QFLAG_I8A`` set (:func:`format_code` with
``int8_activations``) names the same weight multiplied with 8-bit activations and integer
dot products (``csrc/qgemm_i8.h``), over a packed layout of its own.
"""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels.cpu.abi import CONSTANTS, QUANT_FORMATS
from pagedserve.kernels.quant import QuantizedWeight

INT8_ACTIVATION_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
"""Formats whose products can take 8-bit activations (integer dot products)."""
I8A = CONSTANTS["QFLAG_I8A"]


def format_code(weight: QuantizedWeight, int8_activations: bool = False) -> int:
    """The native library's code of ``weight``'s format; with ``int8_activations``, of its
    product with 8-bit activations where the format has one (else the plain code)."""
    code = QUANT_FORMATS[weight.fmt]
    return code | I8A if int8_activations and weight.fmt in INT8_ACTIVATION_FORMATS else code


def _planes(weight: QuantizedWeight) -> tuple[int | None, int | None, int | None]:
    """Pointers to (d, m, scale) as the C functions take them."""
    weight.require_planes("a product, dequantization or packing from the planes")
    if weight.fmt == "int8":
        return None, None, weight.d.data_ptr()
    if weight.d is None:  # a block format: its scales are in its blocks
        return None, None, None
    return weight.d.data_ptr(), None if weight.m is None else weight.m.data_ptr(), None


def packed_size(lib: ctypes.CDLL, weight: QuantizedWeight, code: int | None = None) -> int:
    """Bytes of ``weight`` packed by :func:`native_pack` (this build's column groups) for
    the product ``code`` (default: :func:`format_code`'s)."""
    code = format_code(weight) if code is None else code
    size = lib.qgemm_packed_size(code, weight.n, weight.k)
    if size < 0:
        raise ValueError(f"qgemm_pack refused a {weight.fmt} [{weight.n}, {weight.k}] weight")
    return size


def native_pack(lib: ctypes.CDLL, weight: QuantizedWeight,
                dst: torch.Tensor | None = None, code: int | None = None) -> torch.Tensor:
    """``weight`` (contiguous planes) packed for :func:`native_linear`'s product ``code``
    (default: :func:`format_code`'s): uint8, in ``dst`` (uint8, at least
    :func:`packed_size` bytes) if given."""
    code = format_code(weight) if code is None else code
    size = packed_size(lib, weight, code)
    packed = torch.empty(size, dtype=torch.uint8) if dst is None else dst[:size]
    d, m, scale = _planes(weight)
    lib.qgemm_pack(code, weight.qs.data_ptr(), d, m, scale, weight.n, weight.k,
                   packed.data_ptr())  # fmt: skip
    return packed


def _pack_key(lib: ctypes.CDLL, weight: QuantizedWeight, code: int) -> tuple:
    """What a packed copy depends on: the build's vector width, the product's code and
    the planes' versions."""
    planes = (weight.qs, weight.d, weight.m)
    return (lib.simd_isa(), code, *(p._version for p in planes if p is not None))


def cached_pack(lib: ctypes.CDLL, weight: QuantizedWeight,
                dst: torch.Tensor | None = None, code: int | None = None) -> torch.Tensor:
    """:func:`native_pack` of ``weight`` for the product ``code`` (into ``dst`` if given),
    kept on the weight and packed again if its planes change or another build level or
    product asks. Once the weight's planes are released the kept copy is the weight: this
    build level's and product's is returned, and no other can be made."""
    code = format_code(weight) if code is None else code
    cached = getattr(weight, "_pagedserve_qgemm_packed", None)
    if weight.released:
        if cached is None or cached[0][:2] != (lib.simd_isa(), code) or dst is not None:
            weight.require_planes("packing for another build level or activation type")
        return cached[1]
    if cached is not None and cached[0] == _pack_key(lib, weight, code) and dst is None:
        return cached[1]
    packed = native_pack(lib, weight, dst, code)
    weight._pagedserve_qgemm_packed = (_pack_key(lib, weight, code), packed)
    return packed


def native_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantizedWeight,
                  bias: torch.Tensor | None, num_threads: int,
                  packed: torch.Tensor | None = None, code: int | None = None) -> torch.Tensor:
    """The native product ``code`` (default: :func:`format_code`'s) of float32 CPU ``x``
    ``[rows, k]`` (unit column stride) and ``weight``, plus ``bias`` (float32 ``[n]``):
    from ``packed`` (:func:`native_pack` of this weight for ``code``) if given, else from
    the weight's contiguous planes, packed for the call."""
    rows = x.shape[0]
    out = x.new_empty(rows, weight.n)
    bias_ptr = None if bias is None else bias.data_ptr()
    fmt = format_code(weight) if code is None else code
    if packed is not None:
        status = lib.qgemm_packed(fmt, x.data_ptr(), x.stride(0), rows, weight.k,
                                  packed.data_ptr(), weight.n, bias_ptr, out.data_ptr(), weight.n,
                                  num_threads)  # fmt: skip
    else:
        d, m, scale = _planes(weight)
        status = lib.qgemm(fmt, x.data_ptr(), x.stride(0), rows, weight.k, weight.qs.data_ptr(),
                           d, m, scale, weight.n, bias_ptr, out.data_ptr(), weight.n,
                           num_threads)  # fmt: skip
    if status != 0:
        raise ValueError(f"qgemm refused a {weight.fmt} [{weight.n}, {weight.k}] weight")
    return out


def native_dequantize(lib: ctypes.CDLL, weight: QuantizedWeight, num_threads: int,
                      rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      packed: torch.Tensor | None = None, code: int | None = None) -> torch.Tensor:
    """float32 ``[n, k]`` (or rows ``rows``, int64) dequantized by the native library:
    from ``packed`` (:func:`native_pack` of this weight at this build level for the
    product ``code``, default :func:`format_code`'s) if given, else from the weight's
    planes; the same values either way."""
    index = None if rows is None else rows.to(torch.int64).contiguous()
    count = weight.n if index is None else index.numel()
    if out is None:
        out = torch.empty(count, weight.k, dtype=torch.float32)
    index_ptr = None if index is None else index.data_ptr()
    if packed is not None:
        status = lib.qdequant_packed(format_code(weight) if code is None else code,
                                     packed.data_ptr(), weight.n, weight.k,
                                     index_ptr, count, out.data_ptr(), num_threads)  # fmt: skip
        if status == -3:
            raise IndexError(f"a row index outside 0..{weight.n - 1} of a "
                             f"{weight.fmt} [{weight.n}, {weight.k}] weight")  # fmt: skip
    else:
        d, m, scale = _planes(weight)
        status = lib.qdequant(format_code(weight), weight.qs.data_ptr(), d, m, scale, weight.k,
                              index_ptr, count, out.data_ptr(), num_threads)  # fmt: skip
    if status != 0:
        raise ValueError(f"qdequant refused a {weight.fmt} [{weight.n}, {weight.k}] weight")
    return out
