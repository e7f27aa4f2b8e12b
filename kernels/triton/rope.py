"""Triton rotate-half RoPE of a step's queries and keys, with the KV-cache write fused in.

One program per token rotates all its query heads and KV heads (``x * cos +
rotate_half(x) * sin``, each product rounded to the dtype and then summed, as
:func:`pagedserve.kernels.layer_ops.apply_rope` computes it) and, with ``WRITE``, stores the
rotated key and the value straight into the token's cache slot (slot -1 skipped): one
launch where the torch ops take about ten for the rotation, one for the contiguous
value and one for the write. Without ``WRITE`` it rotates the query and key in place.
The cos/sin rows are the model's (any RoPE variant: the tables carry the scaling).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, cos_lo, sin_lo, cos_hi, sin_hi, offs_h, offs_d, stride_h, mask,
            HALF: tl.constexpr):  # fmt: skip
    """The rotated halves of the ``[BLOCK_H, BLOCK_HALF]`` heads at ``x_ptr``."""
    lo_ptr = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    lo = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    out_lo = (lo * cos_lo).to(dt).to(tl.float32) - (hi * sin_lo).to(dt).to(tl.float32)
    out_hi = (hi * cos_hi).to(dt).to(tl.float32) + (lo * sin_hi).to(dt).to(tl.float32)
    return out_lo.to(dt), out_hi.to(dt)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, WRITE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c_row = cos_ptr + t * stride_ct + offs_d
    s_row = sin_ptr + t * stride_st + offs_d
    cos_lo = tl.load(c_row, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(c_row + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(s_row, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(s_row + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    offs_q = tl.arange(0, BLOCK_HQ)
    q_mask = (offs_q[:, None] < NUM_Q_HEADS) & d_mask[None, :]
    q_row = q_ptr + t * stride_qt
    q_lo, q_hi = _rotate(q_row, cos_lo, sin_lo, cos_hi, sin_hi, offs_q, offs_d, stride_qh,
                         q_mask, HALF)  # fmt: skip
    q_dst = q_row + offs_q[:, None] * stride_qh + offs_d[None, :]
    tl.store(q_dst, q_lo, mask=q_mask)
    tl.store(q_dst + HALF, q_hi, mask=q_mask)

    offs_k = tl.arange(0, BLOCK_HK)
    k_mask = (offs_k[:, None] < NUM_KV_HEADS) & d_mask[None, :]
    k_row = k_ptr + t * stride_kt
    k_lo, k_hi = _rotate(k_row, cos_lo, sin_lo, cos_hi, sin_hi, offs_k, offs_d, stride_kh,
                         k_mask, HALF)  # fmt: skip
    if WRITE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco \
                + offs_k[:, None] * stride_kch + offs_d[None, :]  # fmt: skip
            tl.store(k_dst, k_lo, mask=k_mask)
            tl.store(k_dst + HALF, k_hi, mask=k_mask)
            v_src = v_ptr + t * stride_vt + offs_k[:, None] * stride_vh + offs_d[None, :]
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco \
                + offs_k[:, None] * stride_vch + offs_d[None, :]  # fmt: skip
            tl.store(v_dst, tl.load(v_src, mask=k_mask), mask=k_mask)
            tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=k_mask), mask=k_mask)
    else:
        k_dst = k_row + offs_k[:, None] * stride_kh + offs_d[None, :]
        tl.store(k_dst, k_lo, mask=k_mask)
        tl.store(k_dst + HALF, k_hi, mask=k_mask)


def fusable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes these: ``[T, H, D]`` q/k with contiguous head dims, an
    even ``D``, and cos/sin ``[T, 1, D]`` rows in their dtype."""
    t, _, d = q.shape
    return (q.dim() == k.dim() == 3 and d % 2 == 0 and k.shape[0] == t and k.shape[2] == d
            and q.stride(2) == 1 and k.stride(2) == 1 and q.dtype == k.dtype
            and all(c.shape == (t, 1, d) and c.stride(2) == 1 and c.dtype == q.dtype
                    for c in (cos, sin)))  # fmt: skip


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` in place (see :func:`fusable`)."""
    _launch(q, k, k, cos, sin, None, None, None)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """Rotate q in place, and write the rotated k and v ``[T, Hkv, D]`` into their cache
    slots (slot -1 skipped); ``k`` itself is left as it was."""
    _launch(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def writes_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> bool:  # fmt: skip
    """Whether :func:`rope_write_kv` takes this value and these caches."""
    return (v.shape == k.shape and v.stride(2) == 1 and k.dtype == v.dtype == k_cache.dtype
            == v_cache.dtype and k_cache.shape[2:] == k.shape[1:]
            and k_cache.stride(3) == 1 and v_cache.stride(3) == 1)  # fmt: skip


def _launch(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    write = k_cache is not None
    if not write:  # the cache arguments are unused: any tensor of the right kind
        k_cache = v_cache = q
        slot_mapping = cos
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))  # fmt: skip
    block_size = k_cache.shape[1] if write else 1
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), *cache_strides,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=k.shape[1], HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_SIZE=block_size, WRITE=write,
    )  # fmt: skip
