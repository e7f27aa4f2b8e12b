"""Whole KV cache blocks copied between the cache and host bytes (the KV block store's
payloads).

A payload is one block's K and V across every layer of the cache, in the cache's element
type, laid out as ``[layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` in C order:
the logical layout every cache indexes as (:func:`pagedserve.kernels.interface.allocate_kv_cache`),
whatever the backend's memory layout, so the bytes depend on the values alone. The
layout string (:attr:`KVBlockCopier.layout`) goes into the store's fingerprint.

On the CPU each block is one strided copy straight between its place in the cache and
its own host buffer; on CUDA a call's blocks are gathered (or scattered) together and
moved in one transfer each way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch


class KVBlockCopier:
    """Reads and writes whole blocks of ``kv_cache``, indexed ``[layers, 2, blocks,
    block_size, num_kv_heads, head_dim]``."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"a KV cache of [layers, 2, blocks, block_size, heads, dim], got "
                             f"{tuple(kv_cache.shape)}")  # fmt: skip
        self.kv_cache = kv_cache
        layers, _, _, block_size, heads, dim = kv_cache.shape
        self.block_shape = (layers, 2, block_size, heads, dim)
        self.block_nbytes = math.prod(self.block_shape) * kv_cache.element_size()

    @property
    def layout(self) -> str:
        """The payload's layout and element type, for the store's fingerprint."""
        dtype = str(self.kv_cache.dtype).removeprefix("torch.")
        return "kv[layer,2,token,head,dim]=" + "x".join(map(str, self.block_shape)) + f":{dtype}"

    def read(self, block_ids: Sequence[int]) -> list[bytes | memoryview]:
        """The payloads of ``block_ids``, host bytes of their own (the store keeps them).

        On the CPU each block is copied once, into a buffer of its own (a memoryview of
        bytes); on a GPU the blocks are gathered and moved in one transfer."""
        if not block_ids:
            return []
        cache = self.kv_cache
        if cache.device.type == "cpu":
            out: list[bytes | memoryview] = []
            for b in block_ids:
                host = np.empty(self.block_nbytes, dtype=np.uint8)
                torch.from_numpy(host).view(cache.dtype).view(self.block_shape).copy_(
                    cache[:, :, b])
                out.append(memoryview(host))
            return out
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        blocks = cache.index_select(2, idx).movedim(2, 0).contiguous()
        host = blocks.to("cpu").view(torch.uint8).reshape(len(block_ids), -1).numpy()
        return [host[i].tobytes() for i in range(len(block_ids))]

    def write(self, block_ids: Sequence[int], payloads: Sequence[object]) -> None:
        """Copy ``payloads`` (bytes-like, :attr:`block_nbytes` each) into ``block_ids``.

        On the CPU each payload is copied straight into its block's place (one strided
        copy per block, no staging: a restart's first request waits for these copies);
        on a GPU they are staged in one host array and moved in one transfer."""
        if not block_ids:
            return
        cache = self.kv_cache
        if cache.device.type == "cpu":
            with warnings.catch_warnings():  # the payload is only read
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                for b, payload in zip(block_ids, payloads, strict=True):
                    src = torch.frombuffer(payload, dtype=cache.dtype)  # type: ignore[call-overload]
                    cache[:, :, b].copy_(src.view(self.block_shape))
            return
        n = len(block_ids)
        host = np.empty((n, self.block_nbytes), dtype=np.uint8)
        for i, payload in enumerate(payloads):
            host[i] = np.frombuffer(payload, dtype=np.uint8)  # type: ignore[call-overload]
        values = torch.from_numpy(host).view(cache.dtype).reshape(n, *self.block_shape)
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        cache[:, :, idx] = values.to(cache.device).movedim(0, 2)
