"""Batched torch reference for paged KV writes and paged attention.

These functions are the test oracle for every backend and are readable rather than
fast: they gather each request's context into a padded tensor and attend in
float32, returning the input dtype. Cache layout and slot conventions are those of
:mod:`pagedserve.kernels.interface`.

Two per-layer options, as HF transformers computes them (``window``: its
``sliding_window_overlay``; ``softcap``: Gemma 2's eager attention):

* ``window`` > 0: the query at position ``p`` attends to positions ``p - window + 1 ..
  p`` only (its last ``window`` positions, itself included); 0 = its whole context;
* ``softcap`` > 0: every scaled score ``s`` becomes ``softcap * tanh(s / softcap)``
  before the mask and the softmax; 0 = unchanged.

An int8 cache's rows are written by :func:`quantize_kv_rows` and read back through
:func:`dequantize_kv_rows`.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.interface import KV_INT8_SCALE_BYTES
from pagedserve.kernels.paged_index import context_slots, flat_to_padded_index, padded_query_rows


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., D]`` as an int8 cache's rows ``[..., D + KV_INT8_SCALE_BYTES]``: per
    row, scale ``d = max |x| / 127`` and codes ``round-half-even(x * (1 / d))`` (0 for a
    zero row, and for NaN values), then ``d``'s float32 bytes. The native kernels'
    KV write gives the same bits."""
    x = x.float()
    amax = x.abs().nan_to_num(nan=0.0).amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(x * inv).clamp(-127, 127).nan_to_num(nan=0.0).to(torch.int8)
    return torch.cat([codes, d.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """An int8 cache's rows ``[..., D + KV_INT8_SCALE_BYTES]`` as float32 ``[..., D]``:
    each code times its row's scale."""
    scale = rows[..., -KV_INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return rows[..., :-KV_INT8_SCALE_BYTES].float() * scale


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into their slots (quantized into an int8
    cache); slot -1 is skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    for src, cache in ((key, k_cache), (value, v_cache)):
        rows = src[valid]
        cache[block, offset] = (quantize_kv_rows(rows) if cache.dtype == torch.int8
                                else rows.to(cache.dtype))  # fmt: skip


def _context_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows at ``slots`` ``[B, L]`` as float32 ``[B, L, Hkv, D]``."""
    rows = cache.reshape(-1, cache.shape[2], cache.shape[3])[slots]
    return dequantize_kv_rows(rows) if cache.dtype == torch.int8 else rows.float()


def _attend_fp32(
    query: torch.Tensor,
    slots: torch.Tensor,
    allowed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of padded queries ``[B, Q, Hq, D]`` over gathered slots ``[B, L]``.

    ``allowed`` is ``[B, Q, L]`` (True = attend). Returns ``[B, Q, Hq, D]`` float32.
    """
    b, q_len, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k, v = _context_rows(k_cache, slots), _context_rows(v_cache, slots)
    q = query.float().view(b, q_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("bqhgd,blhd->bhgql", q, k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgql,blhd->bqhgd", probs, v)
    return out.reshape(b, q_len, num_heads, head_dim)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per request attending to its context (its last ``window``
    positions when ``window`` > 0).

    query ``[B, Hq, D]``, block_tables ``[B, M]`` int32, seq_lens ``[B]`` int32;
    returns ``[B, Hq, D]`` in the query dtype.
    """
    b = query.shape[0]
    if b == 0:
        return torch.empty_like(query)
    max_len = int(seq_lens.max())
    slots = context_slots(block_tables, seq_lens, max_len, k_cache.shape[1])
    pos = torch.arange(max_len, device=query.device)
    lens = seq_lens.to(query.device).long()[:, None, None]
    allowed = pos[None, None, :] < lens
    if window > 0:
        allowed &= pos[None, None, :] >= lens - window
    out = _attend_fp32(query[:, None], slots, allowed, k_cache, v_cache, scale, softcap)
    return out[:, 0].to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of varlen query chunks over their paged contexts (each query
    over its last ``window`` positions when ``window`` > 0).

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the last
    positions of its ``seq_lens[i]``-token context (already written to the cache).
    query ``[T, Hq, D]``; returns ``[T, Hq, D]``; rows outside every chunk are zero.
    """
    out = torch.zeros_like(query)
    b = seq_lens.numel()
    if b == 0:
        return out
    first, last = int(query_start_loc[0]), int(query_start_loc[-1])
    num_tokens = last - first
    if num_tokens == 0:
        return out
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    max_len = int(seq_lens.max())
    token_index, position, _ = padded_query_rows(
        query_start_loc, seq_lens, max_q_len, query.shape[0]
    )
    slots = context_slots(block_tables, seq_lens, max_len, k_cache.shape[1])
    pos = torch.arange(max_len, device=query.device)
    allowed = pos[None, None, :] <= position[:, :, None]
    if window > 0:
        allowed &= pos[None, None, :] > position[:, :, None] - window
    padded = _attend_fp32(query[token_index], slots, allowed, k_cache, v_cache, scale,
                          softcap)
    back = flat_to_padded_index(query_start_loc, max_q_len, num_tokens)
    out[first:last] = padded.reshape(-1, *query.shape[1:])[back].to(query.dtype)
    return out
