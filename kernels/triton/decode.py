"""Triton paged decode attention with GQA and split-KV (flash-decoding).

Grid ``(B, Hkv, num_partitions)``: a program serves every query head of one KV-head
group (the ``G = Hq / Hkv`` heads are rows of one ``tl.dot``, padded to 16) over one
partition of the context, walking it ``BLOCK_N`` tokens at a time through the block
table with an fp32 online softmax. With one partition the program writes the output;
otherwise it writes its running max, sum and accumulator and :func:`_reduce_kernel`
combines the partitions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import LOG2E, mma, needs_upcast

BLOCK_N = 32
"""Context tokens per inner iteration (any block size works: addresses are per token)."""
DEFAULT_PARTITION = 512
"""Tokens per partition when the context is split."""
ENOUGH_PROGRAMS = 512
"""With at least this many (request, KV head) programs the GPU is full: no split."""


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale_log2, partition, num_parts,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if SPLIT:
        start = part * partition
        end = tl.minimum(start + partition, seq_len)
    else:
        start = 0
        end = seq_len

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = offs_n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + block[:, None] * stride_kcb + offset[:, None] * stride_kco
            + kv_head * stride_kch + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        s = mma(q, tl.trans(k), UPCAST) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
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

    store_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=store_mask,
        )  # fmt: skip
    else:
        # Partials are contiguous: m/l [B, Hq, num_parts], acc [B, Hq, num_parts, HEAD_DIM].
        num_heads = tl.num_programs(1) * GROUP
        row = (b.to(tl.int64) * num_heads + heads) * num_parts + part
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)


@triton.jit
def _reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr, out_ptr,
    partition, num_parts, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Grid ``(B, Hq)``: combine the partitions of one request and query head."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    used = tl.cdiv(seq_len, partition)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < used
    d_mask = offs_d < HEAD_DIM
    row = (b.to(tl.int64) * tl.num_programs(1) + head) * num_parts + offs_p
    m = tl.load(part_m_ptr + row, mask=p_mask, other=float("-inf"))
    l_part = tl.load(part_l_ptr + row, mask=p_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=p_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l_part, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)  # fmt: skip


def choose_partition(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int | None:
    """Tokens per partition, or None for a single pass without reduce."""
    if max_seq_len <= DEFAULT_PARTITION or num_seqs * num_kv_heads >= ENOUGH_PROGRAMS:
        return None
    return DEFAULT_PARTITION


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    partition_size: int | None = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request attending to its whole paged context.

    Same contract as :func:`kernels.torch_ref.paged_decode_attention`. ``max_seq_len``
    (host side) avoids a device sync; ``partition_size`` is -1 for automatic, None for a
    single pass, or the tokens per partition (rounded up to a multiple of ``BLOCK_N``)
    for split-KV; ``out`` receives the result.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert query.dtype == k_cache.dtype == v_cache.dtype, "query and cache dtypes differ"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache head_dim must be contiguous"
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if partition_size == -1:
        partition_size = choose_partition(num_seqs, num_kv_heads, max_seq_len)
    if partition_size is None:
        partition, num_parts = 0, 1
    else:
        partition = triton.cdiv(max(partition_size, 1), BLOCK_N) * BLOCK_N
        num_parts = triton.cdiv(max(max_seq_len, 1), partition)
    split = num_parts > 1
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if split:
        part_m = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32,
                             device=query.device)  # fmt: skip
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32,
                               device=query.device)  # fmt: skip
    else:
        part_m = part_l = part_acc = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, part_m, part_l, part_acc,
        scale * LOG2E, partition, num_parts,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, SPLIT=split,
        UPCAST=needs_upcast(_decode_kernel, query.dtype),
    )  # fmt: skip
    if split:
        _reduce_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, seq_lens, out,
            partition, num_parts, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_P=max(2, triton.next_power_of_2(num_parts)),
        )  # fmt: skip
    return out
