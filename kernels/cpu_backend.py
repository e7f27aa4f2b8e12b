"""The default CPU backend: the torch backend with native decode attention and layer ops.

Decode rows (one query token each) are attended by ``csrc/paged_attention_cpu.c``,
which reads K/V in place through the block tables: each K and V row is read from
memory once per layer, with no gather copy and no padding to the longest context.
Its ``ops`` are :class:`NativeLayerOps` (fused RMSNorm with the residual add, RoPE,
SiLU-and-multiply). Prefill chunks and KV writes are :class:`TorchBackend`'s.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels import cpu_native
from kernels.interface import AttentionMetadata
from kernels.layer_ops import NativeLayerOps
from kernels.torch_backend import TorchBackend


@dataclass(slots=True)
class _NativeDecodes:
    block_tables: torch.Tensor
    """[num_decodes, max_blocks] int32, contiguous."""
    seq_lens: torch.Tensor
    """[num_decodes] int32."""
    max_seq_len: int


class CpuBackend(TorchBackend):
    """Paged attention on the CPU: native decode kernel, SDPA for prefill chunks."""

    name = "cpu"

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__()
        self._lib = lib
        self.ops = NativeLayerOps(lib)

    def _plan_decodes(
        self, meta: AttentionMetadata, seq_lens: list[int], block_size: int
    ) -> _NativeDecodes | None:
        nd = len(seq_lens)
        if nd == 0:
            return None
        tables = meta.block_tables[:nd].to(torch.int32).contiguous()
        lens = meta.seq_lens[:nd].to(torch.int32).contiguous()
        return _NativeDecodes(tables, lens, max(seq_lens))

    def _attend_decodes(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        plan: _NativeDecodes = meta.prepared.decode
        return cpu_native.paged_decode_attention(
            self._lib, query[: meta.num_decodes], k_cache, v_cache, plan.block_tables,
            plan.seq_lens, plan.max_seq_len, scale, out=out,
        )  # fmt: skip
