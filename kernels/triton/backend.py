"""Attention backend running the Triton kernels (decode group -> split-KV decode
kernel, prefill group -> varlen prefill kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.interface import AttentionMetadata
from kernels.layer_ops import LayerOps, TorchLayerOps
from kernels.quant import QK, QuantizedWeight
from kernels.triton.decode import choose_partition, paged_decode_attention
from kernels.triton.prefill import paged_prefill_attention
from kernels.triton.quant_matmul import quant_matmul
from kernels.triton.write_kv import write_kv


class TritonLayerOps(TorchLayerOps):
    """Torch layer ops, with weight-only quantized linears through the Triton
    dequantizing matmul (:mod:`kernels.triton.quant_matmul`)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight) and weight.k % QK == 0 and x.dim() == 2:
            return quant_matmul(x, weight, bias)
        return super().linear(x, weight, bias)


@dataclass(slots=True)
class TritonStepPlan:
    """Host-side launch sizes of one step, made once by :meth:`TritonBackend.prepare`."""

    num_tokens: int
    num_decodes: int
    decode_max_len: int
    num_prefills: int
    prefill_max_q_len: int
    decode_partition: int | None
    """Split-KV partition for the decode group (None: single pass); needs Hkv, so it
    is chosen on the first layer and reused."""
    partition_chosen: bool = False


class TritonBackend:
    """Paged attention with Triton kernels; the CUDA path of the engine."""

    name = "triton"

    def __init__(self, ops: LayerOps | None = None) -> None:
        self.ops: LayerOps = TritonLayerOps() if ops is None else ops
        """Layer ops: torch, quantized linears in Triton (CUDA graphs capture both)."""

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Host-side sizes for this step's launches (no device syncs when the host
        lists of the metadata are filled)."""
        meta.prepared = self.make_plan(meta)

    @staticmethod
    def make_plan(meta: AttentionMetadata) -> TritonStepPlan:
        """The step's :class:`TritonStepPlan`."""
        qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        nd = meta.num_decodes
        q_lens = [b - a for a, b in zip(qsl[nd:-1], qsl[nd + 1 :], strict=True)]
        return TritonStepPlan(
            num_tokens=qsl[-1] if qsl else 0,
            num_decodes=nd,
            decode_max_len=max(seq_lens[:nd], default=0),
            num_prefills=len(seq_lens) - nd,
            prefill_max_q_len=max(q_lens, default=0),
            decode_partition=None,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend; ``[T, Hq, D]`` -> ``[T, Hq, D]``."""
        st = meta.plan(TritonStepPlan)
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        if query.shape[0] > st.num_tokens:
            out = torch.zeros_like(query)
        else:
            out = torch.empty_like(query)
        nd = st.num_decodes
        if nd:
            if not st.partition_chosen:
                st.decode_partition = choose_partition(nd, k_cache.shape[2], st.decode_max_len)
                st.partition_chosen = True
            paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                max_seq_len=st.decode_max_len, partition_size=st.decode_partition, out=out[:nd],
            )  # fmt: skip
        if st.num_prefills:
            # Absolute query_start_loc rows: the kernel reads and writes the full tensors.
            paged_prefill_attention(
                query, k_cache, v_cache, meta.block_tables[nd:],
                meta.query_start_loc[nd:], meta.seq_lens[nd:], scale,
                max_query_len=st.prefill_max_q_len, out=out,
            )  # fmt: skip
        return out
