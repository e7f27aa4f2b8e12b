"""The seam between the model and the attention kernels.

KV cache layout (one tensor per layer and per K/V)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

indexed so by every backend. A backend whose ``kv_heads_first`` is true gets a
``transpose(1, 2)`` view of contiguous ``[num_blocks, num_kv_heads, block_size,
head_dim]`` memory instead (each KV head's rows of a block one run); the others get
contiguous tensors.

An int8 cache (``kv_cache_dtype="int8"``, the CPU backend's) holds each KV head's row
as its ``head_dim`` codes followed by their float32 scale, ``KV_INT8_SCALE_BYTES`` more
bytes: its last dimension is :func:`kv_row_width` (see :func:`pagedserve.kernels.torch_ref.quantize_kv_rows`).

A *slot* is ``block_id * block_size + offset``; ``slot_mapping[t] == -1`` marks a
padding token whose K/V is not written.

A step is one flat, unpadded batch of ``T`` tokens from ``B`` requests. The model
runner orders requests so that the ``num_decodes`` requests with exactly one query
token (decodes) come first, followed by the prefill chunks. Request ``i`` owns query
tokens ``query_start_loc[i]:query_start_loc[i+1]``; those are the *last*
``q_len`` positions of its context of ``seq_lens[i]`` tokens (earlier tokens are read
from the cache through ``block_tables[i]``), and attention is causal.

Backends are chosen in :mod:`pagedserve.kernels.registry`, each with the
:class:`~pagedserve.kernels.layer_ops.LayerOps` the model runs beside it. Each backend turns the
step's metadata into its own typed per-step plan once per step (``prepare``), which
every layer's ``forward`` reads back with :meth:`AttentionMetadata.plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from pagedserve.kernels.layer_ops import LayerOps
from pagedserve.kernels.quant import QuantizedWeight, StackedWeight

Weight = torch.Tensor | QuantizedWeight | StackedWeight

PlanT = TypeVar("PlanT")


KV_INT8_SCALE_BYTES = 4
"""Bytes after an int8 cache row's codes: its float32 scale (``csrc/abi.h``'s
``KV_I8_SCALE_BYTES``)."""


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a cache of ``dtype`` for heads of ``head_dim``: the head dim,
    and for an int8 cache the scale's bytes after it."""
    return head_dim + KV_INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def allocate_kv_cache(shape: tuple[int, ...], heads_first: bool,
                      empty: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """A KV cache indexed as ``[..., num_blocks, block_size, num_kv_heads, head_dim]``
    (``shape``), from ``empty(dims)`` memory laid out as a backend wants it: with
    ``heads_first`` (the backend's ``kv_heads_first``), the view of contiguous ``[...,
    num_blocks, num_kv_heads, block_size, head_dim]`` memory."""
    if not heads_first:
        return empty(shape)
    *lead, block_size, num_kv_heads, head_dim = shape
    return empty((*lead, num_kv_heads, block_size, head_dim)).transpose(-3, -2)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, built once per step by the model runner."""

    slot_mapping: torch.Tensor
    """[T] int64, -1 = do not write."""
    query_start_loc: torch.Tensor
    """[B + 1] int32, cumulative query lengths."""
    seq_lens: torch.Tensor
    """[B] int32, context length per request including this step's tokens."""
    block_tables: torch.Tensor
    """[B, max_blocks_per_seq] int32, padded with 0."""
    num_decodes: int
    """The first ``num_decodes`` requests have exactly one query token."""
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    prepared: object | None = None
    """The backend's typed per-step plan made by ``AttentionBackend.prepare`` (gather
    indices, masks, launch sizes); shared by every layer of the step."""
    other_groups: tuple[AttentionMetadata, ...] = ()
    """With several KV groups, the metadata of groups 1, 2, ... (their own block tables
    and slots; this one is group 0's): a layer reads its group's."""

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def groups(self) -> tuple[AttentionMetadata, ...]:
        """Every KV group's metadata, group 0 (this one) first."""
        return (self, *self.other_groups)

    def plan(self, kind: type[PlanT]) -> PlanT:
        """The per-step plan of type ``kind`` that ``prepare`` made for this step."""
        plan = self.prepared
        if type(plan) is not kind:
            made = "none" if plan is None else type(plan).__name__
            raise RuntimeError(f"attention metadata holds plan {made}, not {kind.__name__}: "
                               "call the backend's prepare() once per step first")  # fmt: skip
        return plan

    @classmethod
    def from_host(
        cls,
        slot_mapping: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        num_decodes: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Metadata from host-side lists and tensors, moved to ``device`` once."""
        return cls(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            num_decodes=num_decodes,
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:],
                                                    strict=False)),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """A layer's mixture of experts, as :class:`LayerWeights` holds it: the router
    ``[E, hidden]``, each expert's fused gate/up ``[2 inter, hidden]`` and down ``[hidden,
    inter]``, and Qwen2-MoE's shared expert with its one-row gate (None without one).
    ``orders``: per expert and for the shared expert, (gate/up, down) input orders."""

    top_k: int
    norm_topk_prob: bool
    router: Weight
    gate_up: tuple[Weight, ...]
    down: tuple[Weight, ...]
    orders: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...]
    shared_gate: Weight | None = None
    shared_gate_up: Weight | None = None
    shared_down: Weight | None = None
    shared_orders: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights, as :class:`DecoderStack` lists them."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Weight
    """The fused Q/K/V projection ``[q + 2 kv, hidden]``."""
    o: Weight
    gate_up: Weight | None
    """The fused gate/up projection ``[2 intermediate, hidden]`` (None with experts)."""
    down: Weight | None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    """Per-head RMSNorm weights of the queries and keys (Qwen3), or None."""
    k_norm: torch.Tensor | None = None
    orders: tuple[torch.Tensor | None, ...] = (None, None, None, None)
    """Per projection (qkv, o, gate_up, down): the order of its input's columns that its
    weight's columns are stored in (int64 ``[k]``; act-order checkpoints), or None."""
    experts: ExpertWeights | None = None
    """The layer's experts, in place of the dense MLP."""
    window: int = 0
    """The layer's sliding window (0: it attends to its whole context)."""
    attn_out_norm: torch.Tensor | None = None
    """Gemma: the RMSNorm weights of the attention's output before its residual add."""
    mlp_out_norm: torch.Tensor | None = None
    """Gemma: the RMSNorm weights of the MLP's output before its residual add."""
    rope_cos: torch.Tensor | None = None
    """The layer's own RoPE tables (Gemma 3's sliding layers), or None: the stack's."""
    rope_sin: torch.Tensor | None = None
    kv_group: int = 0
    """The KV group whose block tables and slots the layer's attention takes (the step
    metadata's ``groups[kv_group]``)."""


@dataclass(frozen=True, slots=True)
class DecoderStack:
    """A model's decoder layers as a backend that runs them all in one call sees them
    (``run_layers``): sizes, weights and float32 RoPE tables ``[max_len, head_dim]``.
    Each layer is pre-norm attention then a gated MLP (or a mixture of experts), with the
    residual add fused into the next norm; Gemma's layers also norm both outputs before
    their residual adds."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    scale: float
    layers: tuple[LayerWeights, ...]
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    activation: str = "silu"
    """The gated MLP's activation: ``silu`` or ``gelu_tanh``."""
    softcap: float = 0.0
    """The attention scores' soft cap (Gemma 2; 0: none)."""


class AttentionBackend(Protocol):
    """Paged attention over the KV cache; made by :func:`pagedserve.kernels.registry.select_kernels`."""

    name: str
    ops: LayerOps
    """The layer ops chosen with this backend (the same object as
    :attr:`pagedserve.kernels.registry.Kernels.ops`)."""

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Once per step, before the layers run: set ``meta.prepared`` to this backend's
        plan of the step."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend.

        query [T, Hq, D], key/value [T, Hkv, D]; returns [T, Hq, D]. The layer's options
        (:mod:`pagedserve.kernels.torch_ref` defines them): ``window`` > 0, a sliding window
        of that many positions; ``softcap`` > 0, scores capped by tanh (Gemma 2).

        A backend may also offer ``rope_forward(query, key, value, cos, sin, k_cache,
        v_cache, meta, scale, window=0, softcap=0.0)``: ``ops.rope`` then ``forward`` with the rotation fused
        into the K/V write (the Triton backend); the model calls it where it exists.

        A backend may also offer ``run_layers(stack, hidden, positions, kv_caches,
        meta)``: every layer of a :class:`DecoderStack` at once, returning ``(last MLP
        output, residual)`` as the per-layer loop would, or None for a step it does not
        take (the model then runs the loop).
        """
        ...
