"""Quantized weights for the kernel tests: random planes and the reference comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.quant import BLOCK_BYTES, BLOCK_WEIGHTS, QuantizedWeight, quantize_int8

F16_FIELDS = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
"""Byte offsets of the float16 fields (d, then m / dmin) in each block format's block."""


def random_blocks(fmt: str, n: int, k: int, seed: int = 0, scales: tuple[float, ...] = (0.02, 0.05),
                  generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
    """uint8 ``[n, k / block weights * block bytes]``: valid random blocks of block format
    ``fmt``. Any bytes are valid codes and sub-block scales; the float16 fields (d, m /
    dmin) are normal with standard deviations ``scales`` (the first for d, the second for
    the others), so they are finite."""
    g = generator or torch.Generator().manual_seed(seed)
    nb = k // BLOCK_WEIGHTS[fmt]
    raw = torch.randint(0, 256, (n, nb, BLOCK_BYTES[fmt]), generator=g, dtype=torch.uint8)
    for i, ofs in enumerate(F16_FIELDS[fmt]):
        value = (torch.randn(n, nb, generator=g) * scales[min(i, 1)]).half()
        raw[..., ofs:ofs + 2] = value.view(torch.uint8).view(n, nb, 2)
    return raw.reshape(n, -1).contiguous()


def block_k(fmt: str, k: int) -> int:
    """A k with as many of ``fmt``'s blocks as ``k`` has 32-weight blocks (the tests' k
    for the K-quants, whose blocks are 256 wide)."""
    return k * BLOCK_WEIGHTS[fmt] // 32 if BLOCK_WEIGHTS[fmt] > 32 else k


def random_weight(fmt: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """Codes over their whole range, scales of either sign, offsets where the format has them."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        return quantize_int8(torch.randn(n, k, generator=g))
    if fmt in BLOCK_BYTES:
        return QuantizedWeight(fmt, n, k, random_blocks(fmt, n, k, generator=g), None)
    w = QuantizedWeight.empty(fmt, n, k)
    if fmt == "q8_0":
        w.qs.copy_(torch.randint(-128, 128, w.qs.shape, generator=g).to(torch.int8))
    else:
        w.qs.copy_(torch.randint(0, 256, w.qs.shape, generator=g).to(torch.uint8))
    w.d.copy_((torch.randn(w.d.shape, generator=g) * 0.02).half())
    if w.m is not None:
        w.m.copy_((torch.randn(w.m.shape, generator=g) * 0.05).half())
    return w


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, k]`` as the 8-bit-activation products see it: each 32 elements of a
    row quantized as GGML's Q8_0 does (d = max |x| / 127, x / d rounded half to even),
    then multiplied back, in float64."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * d.double()).reshape(rows, k)


def assert_product_close(out: torch.Tensor, x: torch.Tensor, w: QuantizedWeight,
                         bias: torch.Tensor | None, int8: bool = False) -> None:
    """Equal to the dequantize-then-matmul reference up to float32 summation order; with
    ``int8``, the reference's x is :func:`int8_activations` of x (the integer products
    are exact, so only the float steps' rounding remains)."""
    xr = int8_activations(x) if int8 else x.double()
    ref = F.linear(xr, w.dequantize().double(), None if bias is None else bias.double())
    scale = F.linear(x.abs().double(), w.dequantize().abs().double()) + 1.0
    err = ((out.double() - ref).abs() / scale).max().item()
    assert err < 1e-5, err
