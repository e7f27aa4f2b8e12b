"""Attention backend running the Triton kernels (decode group -> split-KV decode
kernel, prefill group -> varlen prefill kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.interface import AttentionMetadata
from pagedserve.kernels.layer_ops import LayerOps, TorchLayerOps
from pagedserve.kernels.quant import QK, QuantizedWeight, StackedWeight
from pagedserve.kernels.triton import norm, rope
from pagedserve.kernels.triton.decode import (
    choose_num_splits,
    device_num_sms,
    paged_decode_attention,
)
from pagedserve.kernels.triton.prefill import paged_prefill_attention
from pagedserve.kernels.triton.quant_matmul import quant_matmul
from pagedserve.kernels.triton.write_kv import write_kv


class TritonLayerOps(TorchLayerOps):
    """Torch layer ops, with the RMSNorms (the residual add fused in) and RoPE in one
    Triton launch each (:mod:`pagedserve.kernels.triton.norm`, :mod:`pagedserve.kernels.triton.rope`) and
    weight-only quantized linears through the Triton dequantizing matmul
    (:mod:`pagedserve.kernels.triton.quant_matmul`)."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if norm.fusable(x, weight):
            return norm.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if norm.fusable(residual, weight) and residual.is_contiguous() \
                and delta.shape == residual.shape:  # fmt: skip
            return norm.add_rms_norm(residual, delta, weight, eps)
        return super().add_rms_norm(residual, delta, weight, eps)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """In place when the kernel takes them (see :func:`pagedserve.kernels.triton.rope.fusable`)."""
        if rope.fusable(q, k, cos, sin):
            rope.rope(q, k, cos, sin)
            return q, k
        return super().rope(q, k, cos, sin)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight) and weight.k % QK == 0 and x.dim() == 2:
            return quant_matmul(x, weight, bias)
        if isinstance(weight, StackedWeight):
            return weight.linear(self.linear, x, bias)
        return super().linear(x, weight, bias)


@dataclass(slots=True)
class TritonStepPlan:
    """Host-side launch sizes of one step, made once by :meth:`TritonBackend.prepare`."""

    num_tokens: int
    num_decodes: int
    decode_max_len: int
    num_prefills: int
    prefill_max_q_len: int
    decode_splits: int = 0
    """Split-KV splits per decode request (1: single pass); needs Hkv and the device, so
    it is chosen on the first layer and reused (0: not yet)."""


class TritonBackend:
    """Paged attention with Triton kernels; the CUDA path of the engine."""

    name = "triton"

    def __init__(self, ops: LayerOps | None = None) -> None:
        self.ops: LayerOps = TritonLayerOps() if ops is None else ops
        """Layer ops: torch, quantized linears in Triton (CUDA graphs capture both)."""
        self._num_sms: int | None = None

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
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend; ``[T, Hq, D]`` -> ``[T, Hq, D]``.

        ``window`` > 0: each query attends to its last ``window`` positions only;
        ``softcap`` > 0: scores soft-capped (see :mod:`pagedserve.kernels.torch_ref`)."""
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return self._attend(query, k_cache, v_cache, meta, scale, window, softcap)

    def rope_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """RoPE of ``query``/``key`` and the K/V write in one launch, then attention: what
        ``ops.rope`` and :meth:`forward` compute. ``query`` is rotated in place, ``key``
        is left as it was (only its cache rows are rotated)."""
        if not (rope.fusable(query, key, cos, sin)
                and rope.writes_kv(key, value, k_cache, v_cache)):  # fmt: skip
            query, key = self.ops.rope(query, key, cos, sin)
            return self.forward(query, key, value, k_cache, v_cache, meta, scale, window,
                                softcap)  # fmt: skip
        rope.rope_write_kv(query, key, value, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return self._attend(query, k_cache, v_cache, meta, scale, window, softcap)

    def _attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:  # fmt: skip
        st = meta.plan(TritonStepPlan)
        if query.shape[0] > st.num_tokens:
            out = torch.zeros_like(query)
        else:
            out = torch.empty_like(query)
        nd = st.num_decodes
        if nd:
            if self._num_sms is None:
                self._num_sms = device_num_sms(query.device)
            if not st.decode_splits:
                st.decode_splits = choose_num_splits(nd, k_cache.shape[2], st.decode_max_len,
                                                     self._num_sms)  # fmt: skip
            splits = st.decode_splits
            if 0 < window < st.decode_max_len:
                # The splits share the window only (a layer of its own length).
                splits = choose_num_splits(nd, k_cache.shape[2], window, self._num_sms)
            # Rows [:nd] start where the tensors start: same alignment as the whole ones.
            paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                window=window, softcap=softcap, num_splits=splits, out=out[:nd],
            )  # fmt: skip
        if st.num_prefills:
            # The whole tensors and the first prefill's index (slices would change their
            # alignment, and the compiled variant, with the number of decodes).
            paged_prefill_attention(
                query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                meta.seq_lens, scale, window=window, softcap=softcap,
                max_query_len=st.prefill_max_q_len, out=out, first_req=nd,
            )  # fmt: skip
        return out
