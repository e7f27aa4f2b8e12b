"""Helpers of the kernel tests; the synthetic steps themselves are
:mod:`pagedserve.kernels.cpu.synthetic` (the CPU benchmark uses them too)."""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.synthetic import PagedStep

NATIVE_TOL = {
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    # Both sides compute in float32 from the same cached values; the outputs may differ
    # by one unit in the last place of the output dtype.
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=4e-3, rtol=8e-3),
}
"""The native attention kernel against the torch reference, by query dtype."""


def heads_first(cache: torch.Tensor) -> torch.Tensor:
    """The same values, each block's rows of a KV head contiguous (``KV_HEADS_FIRST``,
    seen through a ``transpose(1, 2)`` view)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def fused_qkv_views(step: PagedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query/key/value as strided views of one fused QKV projection output."""
    t, hq, d = step.query.shape
    hkv = step.key.shape[1]
    qkv = torch.cat([step.query.reshape(t, -1), step.key.reshape(t, -1),
                     step.value.reshape(t, -1)], dim=1)  # fmt: skip
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    return q, k, v
