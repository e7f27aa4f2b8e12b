"""Kernels: paged KV cache writes, paged attention backends and the layer ops beside them.

The interface (:mod:`pagedserve.kernels.interface`, :mod:`pagedserve.kernels.layer_ops`), the registry that
chooses (:mod:`pagedserve.kernels.registry`), the torch reference (:mod:`pagedserve.kernels.torch_ref`) and
torch backend sit here; the native CPU path is :mod:`pagedserve.kernels.cpu`, the CUDA path
:mod:`pagedserve.kernels.triton` (imported only when chosen).
"""

from pagedserve.kernels.interface import AttentionBackend, AttentionMetadata
from pagedserve.kernels.layer_ops import LayerOps
from pagedserve.kernels.registry import Kernels, get_attention_backend, select_kernels
from pagedserve.kernels.settings import KernelSettings
from pagedserve.kernels.torch_ref import paged_decode_attention, paged_prefill_attention, write_kv

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
