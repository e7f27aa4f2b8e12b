"""Triton paged prefill attention over varlen query chunks (causal, GQA).

Grid ``(cdiv(max_q_len, BLOCK_T), Hkv, B)``: a program takes ``BLOCK_T`` query tokens
of one request and all ``G = Hq / Hkv`` query heads that share one KV head, stacked as
``BLOCK_T * BLOCK_G`` rows of one ``tl.dot`` (row ``r`` is token ``r // BLOCK_G``,
head ``r % BLOCK_G``), so each K/V tile is loaded once per group and non-power-of-two
head counts only pad the group. It reads the request's context (earlier chunks and
this one, already written) through the block table ``BLOCK_N`` tokens at a time with
a causal mask and an fp32 online softmax.

With a sliding window (``window`` > 0, ``HAS_WINDOW``) the query at position ``p``
sees positions ``p - window + 1 .. p`` only: a program's loop starts at the first
position its first query token sees (the tokens before it, no row of the program sees,
are neither loaded nor masked), and each row masks the positions below its own window
start. Soft-capping (``softcap`` > 0, ``HAS_SOFTCAP``) maps each scaled score ``s`` to
``softcap * tanh(s / softcap)`` before the mask. Without them (the constexpr flags off)
the kernel is the plain causal one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton.common import (
    dot_block,
    mma,
    needs_upcast,
    score_scales,
    softcap_log2,
)

BLOCK_M = 64
"""Query rows (tokens x heads of a group) per program."""
BLOCK_N = 64
"""Context tokens per inner iteration."""


@triton.jit(do_not_specialize=["first_req", "stride_bt", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr,
    qk_scale, cap_log2, window, first_req,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    t_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2) + first_req
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    m0 = t_block * BLOCK_T
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        prefix = seq_len - q_len
        offs_r = tl.arange(0, BLOCK_T * BLOCK_G)
        tok = m0 + offs_r // BLOCK_G
        g = offs_r % BLOCK_G
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        row_mask = (tok < q_len) & (g < GROUP)
        heads = kv_head * GROUP + g
        rows = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=row_mask[:, None] & d_mask[None, :], other=0.0,
        )  # fmt: skip
        pos = prefix + tok  # absolute context position of each row's query token

        m_i = tl.full([BLOCK_T * BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_T * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_T * BLOCK_G, BLOCK_D], dtype=tl.float32)
        table = block_tables_ptr + b.to(tl.int64) * stride_bt
        kv_end = tl.minimum(seq_len, prefix + m0 + BLOCK_T)
        if HAS_WINDOW:
            kv_start = tl.maximum(prefix + m0 - window + 1, 0)  # the first row's window
        else:
            kv_start = 0
        for n0 in range(kv_start, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < kv_end
            block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            offset = offs_n % BLOCK_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                k_cache_ptr + block[:, None] * stride_kcb + offset[:, None] * stride_kco
                + kv_head * stride_kch + offs_d[None, :],
                mask=kv_mask, other=0.0,
            )  # fmt: skip
            if HAS_SOFTCAP:
                s = softcap_log2(mma(q, tl.trans(k), UPCAST), qk_scale, cap_log2)
            else:
                s = mma(q, tl.trans(k), UPCAST) * qk_scale
            causal = (offs_n[None, :] <= pos[:, None]) & n_mask[None, :]
            if HAS_WINDOW:
                causal = causal & (offs_n[None, :] > pos[:, None] - window)
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_cache_ptr + block[:, None] * stride_vcb + offset[:, None] * stride_vco
                + kv_head * stride_vch + offs_d[None, :],
                mask=kv_mask, other=0.0,
            )  # fmt: skip
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
            m_i = m_new

        out = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :],
        )  # fmt: skip


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    first_req: int = 0,
) -> torch.Tensor:
    """Causal attention of varlen query chunks over their paged contexts (each query
    over its last ``window`` positions when ``window`` > 0; scores soft-capped at
    ``softcap`` when > 0).

    Same contract as :func:`pagedserve.kernels.torch_ref.paged_prefill_attention`, for requests
    ``first_req ..`` of the metadata (the whole tensors are passed with that offset, not
    slices: a slice's alignment would change with the offset, and with it the compiled
    variant). ``max_query_len`` (host side) avoids a device sync; ``out`` receives the
    result (rows outside every chunk are left untouched; zeroed when ``out`` is None).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert query.dtype == k_cache.dtype == v_cache.dtype, "query and cache dtypes differ"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache head_dim must be contiguous"
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.zeros_like(query)
    num_seqs = seq_lens.numel() - first_req
    if num_seqs <= 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        qsl = query_start_loc[first_req:]
        max_query_len = int((qsl[1:] - qsl[:-1]).max())
    if max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_t = max(1, BLOCK_M // block_g)
    grid = (triton.cdiv(max_query_len, block_t), num_kv_heads, num_seqs)
    qk_scale, cap_log2 = score_scales(scale, softcap)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        qk_scale, cap_log2, max(window, 0), first_req,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_G=block_g, BLOCK_T=block_t,
        HEAD_DIM=head_dim, BLOCK_D=dot_block(head_dim),
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        UPCAST=needs_upcast(_prefill_kernel, query.dtype),
        HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
    )  # fmt: skip
    return out
