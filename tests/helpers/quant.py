"""Quantized weights for the kernel tests: random planes and the reference comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.quant import QuantizedWeight, quantize_int8


def random_weight(fmt: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """Codes over their whole range, scales of either sign, offsets where the format has them."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        return quantize_int8(torch.randn(n, k, generator=g))
    w = QuantizedWeight.empty(fmt, n, k)
    if fmt == "q8_0":
        w.qs.copy_(torch.randint(-128, 128, w.qs.shape, generator=g).to(torch.int8))
    else:
        w.qs.copy_(torch.randint(0, 256, w.qs.shape, generator=g).to(torch.uint8))
    w.d.copy_((torch.randn(w.d.shape, generator=g) * 0.02).half())
    if w.m is not None:
        w.m.copy_((torch.randn(w.m.shape, generator=g) * 0.05).half())
    return w


def assert_product_close(out: torch.Tensor, x: torch.Tensor, w: QuantizedWeight,
                         bias: torch.Tensor | None) -> None:
    """Equal to the dequantize-then-matmul reference up to float32 summation order."""
    ref = F.linear(x.double(), w.dequantize().double(), None if bias is None else bias.double())
    scale = F.linear(x.abs().double(), w.dequantize().abs().double()) + 1.0
    err = ((out.double() - ref).abs() / scale).max().item()
    assert err < 1e-5, err
