"""Helpers shared by the Triton attention kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """``tl.dot`` with fp32 accumulation, exact (``ieee``) for fp32 inputs.

    ``UPCAST`` computes it on fp32 copies of the operands (exact for fp16/bf16
    inputs): the Triton interpreter multiplies bf16 operands as raw integers.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


def needs_upcast(kernel: object, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` runs interpreted on a dtype whose ``tl.dot`` it gets wrong."""
    return dtype == torch.bfloat16 and type(kernel).__name__ == "InterpretedFunction"


MIN_DOT_DIM = 16
"""``tl.dot`` needs every dimension of at least 16: head dims below it are padded."""


def dot_block(head_dim: int) -> int:
    """The head-dim tile of the attention kernels: the next power of two, at least
    :data:`MIN_DOT_DIM` (the padding lanes are masked: they load zeros, store nothing)."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))


@triton.jit
def softcap_log2(qk, qk_scale, cap_log2):
    """Soft-capped scores in log2 units: ``softcap * tanh(scale * qk / softcap) * log2(e)``
    from the raw products ``qk``, with ``qk_scale`` and ``cap_log2`` as
    :func:`score_scales` gives them. ``tanh(x) = 1 - 2 / (exp(2x) + 1)`` through one
    ``exp2`` (no tanh the interpreter and every GPU both have); it saturates to +-1
    where the exponential overflows or underflows."""
    return (1.0 - 2.0 / (tl.exp2(qk * qk_scale) + 1.0)) * cap_log2


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """``(qk_scale, cap_log2)`` of the attention kernels: without soft-capping the scores
    are ``qk * qk_scale`` in log2 units (``cap_log2`` unused); with it (``softcap`` >
    0), :func:`softcap_log2` of ``qk``."""
    if softcap > 0:
        return 2.0 * LOG2E * scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0
