"""Weight-only quantized matrices: the formats and their torch reference.

A :class:`QuantizedWeight` is a linear layer's ``[n, k]`` weight kept in a quantized
form and dequantized only inside the product (``ops.linear`` takes it wherever it takes
a float weight). Formats:

- ``q8_0``, ``q4_0``, ``q4_1``: GGUF's block formats (32 weights per block along k, a
  float16 scale per block, and for ``q4_1`` a float16 offset), loaded as the GGUF file
  stores them; 8.5, 4.5 and 5 bits per weight.
- ``int8``: symmetric int8 with one float32 scale per output row, made at load from a
  float checkpoint (:func:`quantize_int8`); 8 bits per weight.

The planes are kept apart (``qs`` the codes, one row per output row; ``d`` the scales;
``m`` the offsets) so each native kernel reads rows as streams. :meth:`dequantize` is the
reference: it computes each weight as GGML's dequantizer does (product rounded, then the
offset added), which is also what transformers' GGUF loader produces. The native
products of these weights are in :mod:`pagedserve.kernels.cpu.quant`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.abi import QK, QUANT_FORMATS

FORMATS = tuple(QUANT_FORMATS)
"""Format names, in the order of the native library's format codes (``QK``, the weights
per block of the GGUF formats, and the codes are declared in ``kernels/cpu/csrc/abi.h``)."""
_BITS = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "int8": 8.0}


@dataclass(eq=False)
class QuantizedWeight:
    """A ``[n, k]`` weight in one of :data:`FORMATS` (see the module docstring)."""

    fmt: str
    n: int
    k: int
    qs: torch.Tensor
    """Codes: int8 ``[n, k]`` (q8_0, int8) or uint8 ``[n, k/2]`` (q4_*)."""
    d: torch.Tensor
    """Scales: float16 ``[n, k/32]``, or float32 ``[n]`` for int8."""
    m: torch.Tensor | None = None
    """Offsets (q4_1 only): float16 ``[n, k/32]``."""
    _released_nbytes: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"quantization format {self.fmt!r}: expected one of {FORMATS}")
        if self.fmt != "int8" and self.k % QK:
            raise ValueError(f"{self.fmt} needs k a multiple of {QK}, got k={self.k}")

    @classmethod
    def empty(cls, fmt: str, n: int, k: int, device: torch.device | str = "cpu") -> QuantizedWeight:
        """Uninitialised planes for an ``[n, k]`` weight (filled with :meth:`copy_rows_`)."""
        if fmt == "int8":
            return cls(fmt, n, k, torch.empty(n, k, dtype=torch.int8, device=device),
                       torch.empty(n, dtype=torch.float32, device=device))  # fmt: skip
        if k % QK:
            raise ValueError(f"{fmt} needs k a multiple of {QK}, got k={k}")
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
        planes = (self.qs, self.d) if self.m is None else (self.qs, self.d, self.m)
        return sum(t.numel() * t.element_size() for t in planes)

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
        self.qs, self.d = self.qs.new_empty(0), self.d.new_empty(0)
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
        self.d[rows].copy_(other.d)
        if self.m is not None:
            self.m[rows].copy_(other.m)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of rows ``index`` (a permutation or a subset), same format."""
        self.require_planes("select_rows")
        return QuantizedWeight(self.fmt, int(index.numel()), self.k, self.qs[index],
                               self.d[index], None if self.m is None else self.m[index])  # fmt: skip

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[n, k]`` (or the rows ``rows``): the torch reference."""
        self.require_planes("dequantize")
        qs, d, m = self.qs, self.d, self.m
        if rows is not None:
            qs, d = qs[rows], d[rows]
            m = None if m is None else m[rows]
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
        return QuantizedWeight(self.fmt, self.n, self.k, self.qs.to(device), self.d.to(device),
                               None if self.m is None else self.m.to(device))  # fmt: skip


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
