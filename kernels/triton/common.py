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
