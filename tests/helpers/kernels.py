"""Helpers of the kernel tests; the synthetic steps themselves are
:mod:`pagedserve.kernels.cpu.synthetic` (the CPU benchmark uses them too)."""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.synthetic import PagedStep


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
