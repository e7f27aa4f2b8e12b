"""Synthetic paged-attention steps: the inputs of the CPU benchmark and of the tests.

A step has random, non-contiguous block tables, a cache pre-filled with the earlier
context, unused blocks (including block 0, the block-table padding) filled with NaN,
and optional trailing padding tokens with slot -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.interface import AttentionMetadata


@dataclass(slots=True)
class PagedStep:
    """One step's inputs: tokens, caches and metadata."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    block_size: int
    scale: float


def make_step(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_pad_tokens: int = 0,
    spare_blocks: int = 3,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> PagedStep:
    """Build a step; requests with ``q_len == 1`` must come first (the decodes)."""
    assert len(seq_lens) == len(q_lens)
    assert all(1 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req, default=1)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    tables: list[list[int]] = []
    for i, nb in enumerate(blocks_per_req):
        tables.append(perm[:nb])
        perm = perm[nb:]
        block_tables[i, :nb] = torch.tensor(tables[-1], dtype=torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots: list[int] = []
    for table, s, q in zip(tables, seq_lens, q_lens, strict=True):
        req_slots = [table[p // block_size] * block_size + p % block_size for p in range(s)]
        prefix = torch.tensor(req_slots[: s - q], dtype=torch.long)
        k_flat, v_flat = (
            k_cache.view(-1, num_kv_heads, head_dim),
            v_cache.view(-1, num_kv_heads, head_dim),
        )
        k_flat[prefix] = torch.randn(len(prefix), num_kv_heads, head_dim, generator=gen).to(dtype)
        v_flat[prefix] = torch.randn(len(prefix), num_kv_heads, head_dim, generator=gen).to(dtype)
        slots.extend(req_slots[s - q :])
    slots.extend([-1] * num_pad_tokens)

    total = len(slots)
    query = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        num_decodes=num_decodes,
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )
    return PagedStep(
        query.to(device), key.to(device), value.to(device),
        k_cache.to(device), v_cache.to(device), meta, block_size, head_dim**-0.5,
    )  # fmt: skip
