"""Triton RMSNorm, alone and fused with the residual add (one launch instead of ~6).

One program per row: ``residual += delta`` (rounded to the row's dtype, as the torch
reference adds), then ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32 over the
rounded sum, rounded to the dtype before the weight multiplies it, as
:func:`pagedserve.kernels.layer_ops.rms_norm` computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, out_ptr, eps,
    stride_x, stride_d, stride_o,
    N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / N
    y = (x32 * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` (2-D rows with contiguous columns, the weight's
    dtype and length)."""
    return (x.dim() == 2 and x.stride(1) == 1 and x.dtype == weight.dtype
            and weight.dim() == 1 and weight.shape[0] == x.shape[1] and weight.stride(0) == 1)  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)`` of 2-D ``x`` (see :func:`fusable`)."""
    out = torch.empty_like(x)
    _launch(x, x, weight, out, eps, add=False)
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``residual += delta`` in place, then ``(residual, rms_norm(residual))``."""
    if delta.shape != residual.shape or delta.stride(1) != 1:
        delta = delta.reshape(residual.shape).contiguous()
    out = torch.empty_like(residual)
    _launch(residual, delta.to(residual.dtype), weight, out, eps, add=True)
    return residual, out


def _launch(x, delta, weight, out, eps: float, add: bool) -> None:
    rows, n = x.shape
    if rows == 0:
        return
    _rms_norm_kernel[(rows,)](
        x, delta, weight, out, eps, x.stride(0), delta.stride(0), out.stride(0),
        N=n, BLOCK=triton.next_power_of_2(n), ADD=add,
    )  # fmt: skip
