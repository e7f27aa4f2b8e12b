"""Whole KV blocks copied out of the cache and back: the store's payloads."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.engine.loop.store_link import model_files_digest
from pagedserve.engine.worker.kv_blocks import KVBlockCopier
from pagedserve.kernels.interface import allocate_kv_cache


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_round_trip_in_the_logical_layout(heads_first, dtype):
    shape = (3, 2, 10, 16, 2, 8)  # layers, K/V, blocks, block size, heads, dim
    torch.manual_seed(0)
    kv = allocate_kv_cache(shape, heads_first, lambda d: torch.randn(d).to(dtype))
    copier = KVBlockCopier(kv)
    assert copier.block_nbytes == 3 * 2 * 16 * 2 * 8 * kv.element_size()
    one, four = copier.read([1, 4])
    assert len(one) == copier.block_nbytes
    # The payload is the block's K and V, layer by layer, token-major, whatever the memory.
    want = kv[:, :, 1].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    assert one == want
    copier.write([7, 2], [one, memoryview(four)])
    assert torch.equal(kv[:, :, 7], kv[:, :, 1]) and torch.equal(kv[:, :, 2], kv[:, :, 4])
    assert not torch.equal(kv[:, :, 3], kv[:, :, 1])
    assert copier.read([]) == [] and copier.write([], []) is None


def test_layouts_of_other_caches_differ():
    a = KVBlockCopier(torch.zeros(3, 2, 4, 16, 2, 8))
    b = KVBlockCopier(torch.zeros(3, 2, 4, 16, 2, 8, dtype=torch.bfloat16))
    c = KVBlockCopier(torch.zeros(3, 2, 4, 32, 2, 8))
    assert len({a.layout, b.layout, c.layout}) == 3


def test_model_digest_follows_contents_names_and_sizes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"w" * 1000)
    first = model_files_digest([tmp_path])
    assert model_files_digest([tmp_path]) == first
    (tmp_path / "model.safetensors").write_bytes(b"w" * 999 + b"x")
    second = model_files_digest([tmp_path])
    assert second != first
    os.rename(tmp_path / "model.safetensors", tmp_path / "other.safetensors")
    assert model_files_digest([tmp_path]) not in (first, second)


def test_a_large_model_is_sampled_with_its_modification_time(tmp_path, monkeypatch):
    from pagedserve.engine.loop import store_link

    monkeypatch.setattr(store_link, "FULL_HASH_BYTES", 10)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 64)
    first = model_files_digest([tmp_path])
    assert model_files_digest([tmp_path]) == first
    os.utime(weights, ns=(1, 1))
    assert model_files_digest([tmp_path]) != first
