"""Weight-only quantized matrices: the formats and their torch reference.

A :class:`QuantizedWeight` is a linear layer's ``[n, k]`` weight kept in a quantized
form and dequantized only inside the product (``ops.linear`` takes it wherever it takes
a float weight). Formats:

- ``q8_0``, ``q4_0``, ``q4_1``: GGUF's block formats (32 weights per block along k, a
  float16 scale per block, and for ``q4_1`` a float16 offset), loaded as the GGUF file
  stores them; 8.5, 4.5 and 5 bits per weight.
- ``int8``: symmetric int8 with one float32 scale per output row, made at load from a
  float checkpoint (:func:`quantize_int8`); 8 bits per weight.
- ``q5_0``, ``q5_1`` (blocks of 32) and the K-quants ``q4_k``, ``q5_k``, ``q6_k`` (super-blocks
  of 256 with 6-bit or 8-bit sub-block scales): kept as the GGUF file stores them, one
  plane ``qs`` whose rows are the row's GGML blocks byte for byte (:data:`BLOCK_BYTES`);
  5.5, 6, 4.5, 5.5 and 6.5625 bits per weight.

The planes of the first four are kept apart (``qs`` the codes, one row per output row;
``d`` the scales; ``m`` the offsets) so each native kernel reads rows as streams; the
block formats' one plane is repacked for the native kernels at load instead.
:meth:`dequantize` is the reference: it computes each weight as GGML's dequantizer
(``gguf.quants.dequantize``) does, bit for bit (products rounded, then the offset added:
the K-quants' sub-block scale ``d * sc`` and offset ``dmin * m`` are rounded to float32
first), which is also what transformers' GGUF loader produces. The native products of
these weights are in :mod:`pagedserve.kernels.cpu.quant`. A :class:`StackedWeight` is a
fused projection whose row ranges are weights of different formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.abi import BLOCK_BYTES, QK, QK_K, QUANT_FORMATS

FORMATS = tuple(QUANT_FORMATS)
"""Format names, in the order of the native library's format codes (``QK``, the weights
per block of the GGUF formats, and the codes are declared in ``kernels/cpu/csrc/abi.h``)."""
BLOCK_FORMATS = tuple(BLOCK_BYTES)
"""The formats held as the GGUF file's blocks (one plane ``qs``, bytes per block in
:data:`BLOCK_BYTES`)."""
BLOCK_WEIGHTS = {fmt: (1 if fmt == "int8" else QK_K if fmt.endswith("_k") else QK)
                 for fmt in FORMATS}  # fmt: skip
"""Weights per block along k of each format (k must be a multiple of it; int8: any k)."""
_BITS = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "int8": 8.0,
         **{fmt: BLOCK_BYTES[fmt] * 8 / BLOCK_WEIGHTS[fmt] for fmt in BLOCK_FORMATS}}  # fmt: skip


@dataclass(eq=False)
class QuantizedWeight:
    """A ``[n, k]`` weight in one of :data:`FORMATS` (see the module docstring)."""

    fmt: str
    n: int
    k: int
    qs: torch.Tensor
    """Codes: int8 ``[n, k]`` (q8_0, int8) or uint8 ``[n, k/2]`` (q4_*); the block
    formats' blocks: uint8 ``[n, k / block weights * block bytes]``."""
    d: torch.Tensor | None
    """Scales: float16 ``[n, k/32]``, or float32 ``[n]`` for int8; None for the block
    formats (their scales are in their blocks)."""
    m: torch.Tensor | None = None
    """Offsets (q4_1 only): float16 ``[n, k/32]``."""
    _released_nbytes: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"quantization format {self.fmt!r}: expected one of {FORMATS}")
        block = BLOCK_WEIGHTS[self.fmt]
        if self.k % block:
            raise ValueError(f"{self.fmt} needs k a multiple of {block}, got k={self.k}")

    @classmethod
    def empty(cls, fmt: str, n: int, k: int, device: torch.device | str = "cpu") -> QuantizedWeight:
        """Uninitialised planes for an ``[n, k]`` weight (filled with :meth:`copy_rows_`)."""
        if fmt == "int8":
            return cls(fmt, n, k, torch.empty(n, k, dtype=torch.int8, device=device),
                       torch.empty(n, dtype=torch.float32, device=device))  # fmt: skip
        if fmt not in FORMATS:
            raise ValueError(f"quantization format {fmt!r}: expected one of {FORMATS}")
        block = BLOCK_WEIGHTS[fmt]
        if k % block:
            raise ValueError(f"{fmt} needs k a multiple of {block}, got k={k}")
        if fmt in BLOCK_BYTES:
            return cls(fmt, n, k, torch.empty(n, k // block * BLOCK_BYTES[fmt], dtype=torch.uint8,
                                              device=device), None)  # fmt: skip
        width = k if fmt == "q8_0" else k // 2
        qtype = torch.int8 if fmt == "q8_0" else torch.uint8
        return cls(
            fmt, n, k, torch.empty(n, width, dtype=qtype, device=device),
            torch.empty(n, k // QK, dtype=torch.float16, device=device),
            torch.empty(n, k // QK, dtype=torch.float16, device=device) if fmt == "q4_1" else None,
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        """Bytes of the planes (what one product reads), released or not."""
        if self._released_nbytes is not None:
            return self._released_nbytes
        return sum(t.numel() * t.element_size() for t in self.planes)

    @property
    def planes(self) -> tuple[torch.Tensor, ...]:
        """The tensors that hold the weight: ``qs``, then ``d`` and ``m`` where it has them."""
        return tuple(p for p in (self.qs, self.d, self.m) if p is not None)

    @property
    def released(self) -> bool:
        """Whether :meth:`release_planes` dropped the planes."""
        return self._released_nbytes is not None

    def release_planes(self) -> None:
        """Free the planes' memory once another copy serves every use of the weight (the
        native CPU kernels' packed copy: ``pagedserve.kernels.cpu.layer_ops.NativeLayerOps``, which
        multiplies and dequantizes from it). :attr:`nbytes` still counts them; the
        methods that read them refuse to."""
        if self.released:
            return
        nbytes = self.nbytes
        self.qs = self.qs.new_empty(0)
        self.d = None if self.d is None else self.d.new_empty(0)
        self.m = None if self.m is None else self.m.new_empty(0)
        self._released_nbytes = nbytes

    def require_planes(self, use: str) -> None:
        """Refuse ``use`` (named in the error) once the planes are released."""
        if self.released:
            raise RuntimeError(
                f"{use} needs the planes of this {self.fmt} [{self.n}, {self.k}] weight, "
                "released once its packed copy was made: use the layer ops that packed it")

    @property
    def bits_per_weight(self) -> float:
        return _BITS[self.fmt]

    def copy_rows_(self, offset: int, other: QuantizedWeight) -> None:
        """Rows ``offset .. offset + other.n`` := ``other`` (same format and k)."""
        self.require_planes("copy_rows_")
        other.require_planes("copy_rows_")
        if other.fmt != self.fmt or other.k != self.k or offset + other.n > self.n:
            raise ValueError(f"cannot put a {other.fmt} [{other.n}, {other.k}] weight at row "
                             f"{offset} of a {self.fmt} [{self.n}, {self.k}] one")  # fmt: skip
        rows = slice(offset, offset + other.n)
        self.qs[rows].copy_(other.qs)
        if self.d is not None:
            self.d[rows].copy_(other.d)
        if self.m is not None:
            self.m[rows].copy_(other.m)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of rows ``index`` (a permutation or a subset), same format."""
        self.require_planes("select_rows")
        return QuantizedWeight(self.fmt, int(index.numel()), self.k, self.qs[index],
                               None if self.d is None else self.d[index],
                               None if self.m is None else self.m[index])  # fmt: skip

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[n, k]`` (or the rows ``rows``): the torch reference."""
        self.require_planes("dequantize")
        qs, d, m = self.qs, self.d, self.m
        if rows is not None:
            qs = qs[rows]
            d = None if d is None else d[rows]
            m = None if m is None else m[rows]
        if self.fmt in BLOCK_BYTES:
            return dequantize_blocks(self.fmt, qs, self.k)
        if self.fmt == "int8":
            return qs.float() * d[:, None]
        count = qs.shape[0]
        if self.fmt == "q8_0":
            q = qs.float().view(count, -1, QK)
        else:
            blocks = qs.view(count, -1, QK // 2)
            q = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).float()
            if self.fmt == "q4_0":
                q = q - 8.0
        w = d.float()[..., None] * q
        if m is not None:
            w = w + m.float()[..., None]
        return w.reshape(count, self.k)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        self.require_planes("to")
        return QuantizedWeight(self.fmt, self.n, self.k, self.qs.to(device),
                               None if self.d is None else self.d.to(device),
                               None if self.m is None else self.m.to(device))  # fmt: skip


def _f16(b: torch.Tensor) -> torch.Tensor:
    """float32 of the little-endian float16 in the last dim's 2 bytes of uint8 ``b``."""
    return b.contiguous().view(torch.float16).float()


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit sub-block scales and mins of Q4_K/Q5_K blocks from their 12 bytes
    (``[..., 12]`` uint8): GGML's ``get_scale_min_k4``. Sub-blocks 0-3 take the low 6
    bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 the nibbles of bytes 8-11 with the top
    2 bits of bytes 0-3 and 4-7 above them."""
    s = scales.to(torch.int32)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)), dim=-1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 6) << 4)), dim=-1)
    return sc, mn


def _bits(h: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    """``(h >> s) & mask`` for each s of ``shifts``, stacked before h's last dim."""
    sh = torch.tensor(list(shifts), dtype=torch.int32, device=h.device)[:, None]
    return (h.to(torch.int32)[..., None, :] >> sh) & mask


def dequantize_blocks(fmt: str, qs: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``[rows, k]`` of block-format rows ``qs`` (uint8 ``[rows, k / block weights
    * block bytes]``, GGML's blocks): ``gguf.quants.dequantize``'s values, bit for bit.

    Layouts (llama.cpp's ``block_*`` structs; a Q5 weight's fifth bit, and Q6_K's top two,
    are ``qh``'s bits):

    - q5_0 ``{half d; u8 qh[4]; u8 qs[16]}``: element j < 16 is ``qs[j]``'s low nibble with
      bit j of ``qh`` (a little-endian u32) above it, j + 16 the high nibble with bit
      j + 16; ``w = d * (q - 16)``.
    - q5_1 ``{half d, m; u8 qh[4]; u8 qs[16]}``: the same codes, ``w = d * q + m``.
    - q4_k ``{half d, dmin; u8 scales[12]; u8 qs[128]}``: 8 sub-blocks of 32 with 6-bit
      scale ``sc`` and min ``mn`` (:func:`_scale_min_k4`); bytes ``32j .. 32j + 31`` hold
      sub-block 2j in their low nibbles, 2j + 1 in their high ones;
      ``w = (d * sc) * q - (dmin * mn)``.
    - q5_k ``{half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}``: q4_k's codes with bit
      s of ``qh[l]`` above element l of sub-block s.
    - q6_k ``{u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}``: element ``128h + 32t + l``
      (h < 2, t < 4, l < 32) is nibble ``t // 2`` of ``ql[64h + 32(t % 2) + l]`` with bits
      ``2t, 2t + 1`` of ``qh[32h + l]`` above it; 16 sub-blocks of 16 with int8 scales,
      ``w = (d * scale) * (q - 32)``.
    """
    rows = qs.shape[0]
    nb = k // BLOCK_WEIGHTS[fmt]
    b = qs.reshape(rows, nb, BLOCK_BYTES[fmt])
    if fmt in ("q5_0", "q5_1"):
        ofs = 2 if fmt == "q5_0" else 4
        h = b[..., ofs:ofs + 4].to(torch.int64)
        qh = h[..., 0] | h[..., 1] << 8 | h[..., 2] << 16 | h[..., 3] << 24
        high = (qh[..., None] >> torch.arange(32, device=qs.device)) & 1
        low = b[..., ofs + 4:ofs + 20]
        q = (torch.cat((low & 0x0F, low >> 4), dim=-1).to(torch.int64) | high << 4)
        d = _f16(b[..., 0:2])
        if fmt == "q5_0":
            w = d * (q - 16).float()
        else:
            w = d * q.float() + _f16(b[..., 2:4])
        return w.reshape(rows, k)
    if fmt in ("q4_k", "q5_k"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _scale_min_k4(b[..., 4:16])
        codes = b[..., -128:].reshape(rows, nb, 4, 1, 32).to(torch.int32)
        q = torch.cat((codes & 0x0F, codes >> 4), dim=3).reshape(rows, nb, 8, 32)
        if fmt == "q5_k":
            q = q | _bits(b[..., 16:48], range(8), 1) << 4
        w = (d * sc.float())[..., None] * q.float() - (dmin * mn.float())[..., None]
        return w.reshape(rows, k)
    if fmt == "q6_k":
        ql = b[..., 0:128].reshape(rows, nb, 2, 1, 64).to(torch.int32)
        low = torch.cat((ql & 0x0F, ql >> 4), dim=3).reshape(rows, nb, 2, 4, 32)
        high = _bits(b[..., 128:192].reshape(rows, nb, 2, 32), range(0, 8, 2), 3)
        q = ((low | high << 4) - 32).float().reshape(rows, nb, 16, 16)
        scale = b[..., 192:208].contiguous().view(torch.int8).float()
        w = (_f16(b[..., 208:210]) * scale)[..., None] * q
        return w.reshape(rows, k)
    raise ValueError(f"{fmt!r} is not a block format ({', '.join(BLOCK_FORMATS)})")


@dataclass(eq=False)
class StackedWeight:
    """A fused projection's ``[n, k]`` weight whose row ranges are quantized weights of
    different formats, ``parts`` in row order (a GGUF file's q/k/v or gate/up whose parts
    differ in type: a Q4_K_M file's ``attn_v`` in Q6_K beside Q4_K ``attn_q``/``attn_k``).
    A product multiplies each part and puts their columns side by side
    (:meth:`linear`)."""

    parts: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        self.parts = tuple(self.parts)
        if not self.parts or len({p.k for p in self.parts}) != 1:
            raise ValueError("a stacked weight needs parts of one k")

    @classmethod
    def empty(cls, rows: list[tuple[str, int]], k: int,
              device: torch.device | str = "cpu") -> StackedWeight:  # fmt: skip
        """Uninitialised parts of ``(format, rows)`` each (filled with :meth:`copy_rows_`)."""
        return cls(tuple(QuantizedWeight.empty(fmt, n, k, device) for fmt, n in rows))

    @property
    def fmt(self) -> str:
        """The parts' formats, in row order (``q4_k+q6_k``)."""
        return "+".join(p.fmt for p in self.parts)

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def released(self) -> bool:
        return all(p.released for p in self.parts)

    @property
    def bits_per_weight(self) -> float:
        return sum(p.bits_per_weight * p.n for p in self.parts) / self.n

    def _spans(self) -> list[tuple[int, QuantizedWeight]]:
        spans, start = [], 0
        for p in self.parts:
            spans.append((start, p))
            start += p.n
        return spans

    def copy_rows_(self, offset: int, other: QuantizedWeight) -> None:
        """Rows ``offset .. offset + other.n`` := ``other``: within one part, of its format."""
        for start, p in self._spans():
            if start <= offset and offset + other.n <= start + p.n:
                p.copy_rows_(offset - start, other)
                return
        raise ValueError(f"cannot put a {other.fmt} [{other.n}, {other.k}] weight at row "
                         f"{offset} of a {self.fmt} [{self.n}, {self.k}] one")  # fmt: skip

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[n, k]`` (or the rows ``rows``): the parts' references stacked."""
        w = torch.cat([p.dequantize() for p in self.parts])
        return w if rows is None else w[rows]

    def to(self, device: torch.device | str) -> StackedWeight:
        return StackedWeight(tuple(p.to(device) for p in self.parts))

    def linear(self, linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``linear(x, part, its bias)`` of each part, the outputs side by side."""
        outs = [linear(x, p, None if bias is None else bias[start:start + p.n])
                for start, p in self._spans()]  # fmt: skip
        return torch.cat(outs, dim=-1)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-row int8 of a float ``[n, k]`` weight (scale = max|w| / 127;
    an all-zero row gets scale 1)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", w.shape[0], w.shape[1], q.contiguous(), scale.contiguous())


def linear_reference(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dequantize(), bias)`` in x's dtype (the torch path)."""
    return F.linear(x, weight.dequantize().to(x.dtype), bias)
