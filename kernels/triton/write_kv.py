"""Triton kernel: scatter this step's K/V into the paged cache (slot -1 skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token; copies all its KV heads."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                    mask=mask)  # fmt: skip
        v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                    mask=mask)  # fmt: skip
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco
        tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
        tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into their slots; slot -1 is skipped."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    key = _last_dim_contiguous(key.to(k_cache.dtype))
    value = _last_dim_contiguous(value.to(v_cache.dtype))
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache head_dim must be contiguous"
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
