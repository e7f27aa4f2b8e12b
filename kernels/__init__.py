"""Attention kernels: paged KV cache writes and paged attention backends."""

from kernels.interface import AttentionBackend, AttentionMetadata
from kernels.registry import get_attention_backend
from kernels.torch_ref import paged_decode_attention, paged_prefill_attention, write_kv

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "get_attention_backend",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]
