"""Triton paged decode attention with GQA and split-KV (flash-decoding).

Grid ``(B, Hkv, num_splits)``: a program serves every query head of one KV-head group
(the ``G = Hq / Hkv`` heads are rows of one ``tl.dot``, padded to 16) over one split of
the context, walking it ``BLOCK_N`` tokens at a time through the block table with an
fp32 online softmax. The number of splits is fixed per launch (from the batch size, the
KV heads and the SM count: :func:`choose_num_splits`), and each program computes its
request's split length from the request's real length, so a launch sized for
``max_model_len`` (a captured graph) does the work of the real contexts only: splits
past a short context are empty. With one split the program writes the output;
otherwise it writes its running max, sum and accumulator, and :func:`_reduce_kernel`
combines them in a loop over the splits (no tile as wide as the split count).

A sliding window (``window`` > 0, ``HAS_WINDOW``) shrinks the range the splits share to
the last ``window`` positions of the context: the loop starts at the first visible
position, so the tokens before the window are neither loaded nor masked (a decode
query is the context's last position: nothing past the range start needs a mask).
Soft-capping (``softcap`` > 0, ``HAS_SOFTCAP``) maps each scaled score ``s`` to
``softcap * tanh(s / softcap)`` (:func:`pagedserve.kernels.triton.common.softcap_log2`).
Without them (the constexpr flags off) the kernel is the plain one.

Integers that vary from step to step (the block-table row stride, the number of splits)
are ``do_not_specialize``, so the kernels compile once per model, never mid-serving.
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

BLOCK_N = 32
"""Context tokens per inner iteration (any block size works: addresses are per token)."""
MIN_SPLIT_TOKENS = 256
"""No split is given less than this many tokens of the longest context on average."""
MAX_SPLITS = 16
"""Most splits per request."""
PROGRAMS_PER_SM = 2
"""(request, KV head, split) programs per SM that fill the GPU."""
INTERPRETED_NUM_SMS = 4
"""The SM count assumed off a GPU (the interpreter), so that split-KV runs in tests."""


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "window"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, cap_log2, window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if HAS_WINDOW:
        # The splits share the window's positions [lo, seq_len) only.
        lo = tl.maximum(seq_len - window, 0)
        if SPLIT:
            split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
            start = lo + part * split_len
            end = tl.minimum(start + split_len, seq_len)
        else:
            start = lo
            end = seq_len
    else:
        if SPLIT:
            split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
            start = part * split_len
            end = tl.minimum(start + split_len, seq_len)
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
        if HAS_SOFTCAP:
            s = softcap_log2(mma(q, tl.trans(k), UPCAST), qk_scale, cap_log2)
        else:
            s = mma(q, tl.trans(k), UPCAST) * qk_scale
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
        # Partials are contiguous: m/l [B, Hq, num_splits], acc [B, Hq, num_splits, HEAD_DIM];
        # an empty split (past its request's context) leaves m = -1e30, l = 0, acc = 0.
        num_heads = tl.num_programs(1) * GROUP
        row = (b.to(tl.int64) * num_heads + heads) * num_splits + part
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid ``(B, Hq)``: combine the splits of one request and query head, one at a time."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row0 = (b.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    m_run = tl.full([1], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, num_splits):
        m = tl.load(part_m_ptr + row0 + i + tl.zeros([1], dtype=tl.int32))
        l_part = tl.load(part_l_ptr + row0 + i + tl.zeros([1], dtype=tl.int32))
        a = tl.load(part_acc_ptr + (row0 + i) * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m_run, m)
        w_run = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)
        l_run = l_run * w_run + l_part * w
        acc = acc * w_run + a * w
        m_run = m_new
    out = acc / l_run
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)  # fmt: skip


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int) -> int:  # fmt: skip
    """Splits per request for a launch of ``num_seqs`` rows whose longest context is
    ``max_seq_len`` (``max_model_len`` for a captured graph): enough (request, KV head,
    split) programs for ``PROGRAMS_PER_SM`` per SM, at most :data:`MAX_SPLITS`, none
    shorter than :data:`MIN_SPLIT_TOKENS` on average; 1 means a single pass."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.cdiv(PROGRAMS_PER_SM * max(num_sms, 1), programs)
    by_length = triton.cdiv(max(max_seq_len, 1), MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def device_num_sms(device: torch.device) -> int:
    """The SM count of ``device`` (:data:`INTERPRETED_NUM_SMS` off a GPU)."""
    if device.type != "cuda":
        return INTERPRETED_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request attending to its paged context (its last ``window``
    positions when ``window`` > 0; scores soft-capped at ``softcap`` when > 0).

    Same contract as :func:`pagedserve.kernels.torch_ref.paged_decode_attention`. ``max_seq_len``
    (host side) avoids a device sync; ``num_splits`` is the splits per request (None:
    :func:`choose_num_splits` for this device, over the window where it is shorter; 1:
    a single pass without reduce); ``out`` receives the result.
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
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if window > 0:
            max_seq_len = min(max_seq_len, window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len,
                                       device_num_sms(query.device))  # fmt: skip
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    split = num_splits > 1
    group = num_heads // num_kv_heads
    block_d = dot_block(head_dim)
    if split:
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                             device=query.device)  # fmt: skip
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=query.device)  # fmt: skip
    else:
        part_m = part_l = part_acc = out  # unused
    qk_scale, cap_log2 = score_scales(scale, softcap)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, part_m, part_l, part_acc,
        qk_scale, cap_log2, max(window, 0), num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, SPLIT=split,
        UPCAST=needs_upcast(_decode_kernel, query.dtype),
        HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
    )  # fmt: skip
    if split:
        _reduce_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out,
            num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
        )  # fmt: skip
    return out
