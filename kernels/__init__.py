"""Kernels: paged KV cache writes, paged attention backends and the layer ops beside them.

The interface (:mod:`kernels.interface`, :mod:`kernels.layer_ops`), the registry that
chooses (:mod:`kernels.registry`), the torch reference (:mod:`kernels.torch_ref`) and
torch backend sit here; the native CPU path is :mod:`kernels.cpu`, the CUDA path
:mod:`kernels.triton` (imported only when chosen).
"""

from kernels.interface import AttentionBackend, AttentionMetadata
from kernels.layer_ops import LayerOps
from kernels.registry import Kernels, get_attention_backend, select_kernels
from kernels.settings import KernelSettings
from kernels.torch_ref import paged_decode_attention, paged_prefill_attention, write_kv

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KernelSettings",
    "Kernels",
    "LayerOps",
    "get_attention_backend",
    "paged_decode_attention",
    "paged_prefill_attention",
    "select_kernels",
    "write_kv",
]
