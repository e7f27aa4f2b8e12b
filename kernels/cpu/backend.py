"""The default CPU backend: one native attention call per layer, native layer ops.

Every query row of a step, decode or prefill, is attended by
``csrc/paged_attention_cpu.c``, which reads K/V in place through the block tables
after this step's K/V are written: no gather copy, no padding to the longest context,
no mask. Decode rows read each K and V row from memory once per layer; a prefill chunk
reads each row once per tile of 16 query tokens, which all take it from L1. Chunks
that continue a cached prefix or an earlier chunk take the same path as whole prompts.
The step's K/V rows are written by the same native call, just before it attends. Its
layer ops are the :class:`~pagedserve.kernels.cpu.layer_ops.NativeLayerOps` of the same library
(fused RMSNorm with the residual add, RoPE, SiLU-and-multiply, the float32 linear),
chosen with it by :func:`pagedserve.kernels.registry.select_kernels`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import native
from pagedserve.kernels.interface import AttentionMetadata, DecoderStack
from pagedserve.kernels.layer_ops import LayerOps


@dataclass(slots=True)
class CpuStepPlan:
    """The native kernel's arguments for one step, made once by :meth:`CpuBackend.prepare`."""

    num_tokens: int
    slot_mapping: torch.Tensor
    """[T] int64, contiguous (-1: padding, not written)."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32, contiguous."""
    seq_lens: torch.Tensor
    """[B] int32."""
    query_start_loc: torch.Tensor | None
    """[B + 1] int32; None when every request decodes one token (rows 0..B-1)."""
    max_seq_len: int


class CpuBackend:
    """Paged attention on the CPU: the native kernel for decodes and prefill chunks."""

    name = "cpu"
    kv_heads_first = True
    """The cache this backend wants: each KV head's rows of a block one contiguous run
    (``native.kv_layout``'s ``KV_HEADS_FIRST``), which a long context's decode streams
    faster than rows of every head (BENCHMARKS.md)."""

    def __init__(self, lib: ctypes.CDLL, ops: LayerOps, fuse_layers: bool = True) -> None:
        self._lib = lib
        self.ops = ops
        self._fused = None
        if fuse_layers:
            from pagedserve.kernels.cpu.decoder import FusedLayers
            from pagedserve.kernels.cpu.layer_ops import NativeLayerOps

            if isinstance(ops, NativeLayerOps):
                self._fused = FusedLayers(lib, ops)

    @property
    def fuses_layers(self) -> bool:
        """Whether steps that fit run every layer in one native call (:meth:`run_layers`)."""
        return self._fused is not None

    def run_layers(self, stack: DecoderStack, hidden: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list, meta: AttentionMetadata):
        """Every layer of ``stack`` in one native call (``pagedserve.kernels.cpu.decoder``):
        ``(last MLP output, residual)``, or None for a step that call does not take."""
        if self._fused is None:
            return None
        return self._fused.run(stack, hidden, positions, kv_caches,
                               [m.plan(CpuStepPlan) for m in meta.groups])

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        meta.prepared = self.make_plan(meta)

    @staticmethod
    def make_plan(meta: AttentionMetadata) -> CpuStepPlan:
        """The step's contiguous int tensors for the native call."""
        qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        decode_only = meta.num_decodes == len(seq_lens)
        return CpuStepPlan(
            qsl[-1] if qsl else 0, meta.slot_mapping.to(torch.int64).contiguous(),
            meta.block_tables.to(torch.int32).contiguous(),
            meta.seq_lens.to(torch.int32).contiguous(),
            None if decode_only else meta.query_start_loc.to(torch.int32).contiguous(),
            max(seq_lens, default=0),
        )  # fmt: skip

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
        """Write this step's K/V, then attend; ``[T, Hq, D]`` -> ``[T, Hq, D]`` (rows past
        the step's tokens, padding, are zero). ``window`` > 0: each query attends to its
        last ``window`` positions only; ``softcap`` > 0: scores soft-capped as Gemma 2's
        (see :func:`pagedserve.kernels.cpu.native.paged_attention`)."""
        window, softcap = native.attention_options(window, softcap)
        plan = meta.plan(CpuStepPlan)
        n = plan.num_tokens
        if n == 0:
            return query.new_zeros(query.shape)
        out = None if query.shape[0] == n else query.new_zeros(query.shape)
        attended = native.paged_attention(
            self._lib, query[:n], k_cache, v_cache, plan.block_tables, plan.seq_lens,
            plan.max_seq_len, scale, out=None if out is None else out[:n],
            query_start_loc=plan.query_start_loc, key=key, value=value,
            slot_mapping=plan.slot_mapping, window=window, softcap=softcap,
        )  # fmt: skip
        return attended if out is None else out
