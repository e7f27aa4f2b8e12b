"""The attention kernel on either KV cache layout: ``[num_blocks, block_size, Hkv, D]``
(a block's rows, each with every KV head) and ``[num_blocks, Hkv, block_size, D]`` (a
block's KV heads, each with its rows in one run), the latter seen through a
``transpose(1, 2)`` view so that every caller indexes the cache the same way. The two
layouts hold the same values and give the same bits, on every build level this CPU
runs."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import write_kv
from pagedserve.kernels.cpu import abi
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.synthetic import make_step
from pagedserve.kernels.interface import allocate_kv_cache
from tests.helpers.kernels import heads_first, refused_c_call

LENS = [1, 2, 15, 16, 17, 31, 33, 100, 257, 700]
"""Decode contexts: within a block, across blocks, and split among threads (700)."""
PREFILL = ([9, 700, 130, 37, 18], [1, 250, 130, 20, 2])
"""Chunks short and long (the tiled path), continuing a cached prefix, beside a decode."""


@pytest.fixture
def lib(native_lib):
    return native_lib


def attend(lib, step, k_cache, v_cache, prefill: bool, **kw) -> torch.Tensor:
    m = step.meta
    qsl = m.query_start_loc if prefill else None
    return cpu_native.paged_attention(lib, step.query, k_cache, v_cache, m.block_tables,
                                      m.seq_lens, max(m.seq_lens_cpu), step.scale,
                                      query_start_loc=qsl, **kw)  # fmt: skip


def test_layout_of_each_cache() -> None:
    rows = torch.zeros(5, 16, 3, 64)
    assert cpu_native.kv_layout(rows) == abi.KV_ROWS_FIRST
    assert cpu_native.kv_layout(heads_first(rows)) == abi.KV_HEADS_FIRST
    # One KV head: both descriptions fit, and both address the same elements.
    assert cpu_native.kv_layout(torch.zeros(5, 16, 1, 64)) is not None
    assert cpu_native.kv_layout(rows.transpose(0, 1)) is None
    assert cpu_native.kv_layout(torch.zeros(5, 16, 3, 128)[..., :64]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
# 64 and 128: the specialised vector paths; 96 the general one; 40 the scalar loops on
# AVX-512 and the general vector path on AVX2.
@pytest.mark.parametrize("head_dim", [64, 128, 96, 40])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_heads_first_gives_the_same_bits(lib, prefill, head_dim, heads, dtype) -> None:
    """Decodes (one pass and split contexts) and prefill chunks (per-token sweeps and
    tiles): NaN in every unused block poisons any read outside a context."""
    seq_lens, q_lens = PREFILL if prefill else (LENS, [1] * len(LENS))
    step = make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=16, dtype=dtype)  # fmt: skip
    write_kv(step.key, step.value, step.k_cache, step.v_cache, step.meta.slot_mapping)
    k, v = heads_first(step.k_cache), heads_first(step.v_cache)
    if heads[1] > 1:  # with one KV head the two layouts are the same
        assert cpu_native.kv_layout(k) == abi.KV_HEADS_FIRST
    want = attend(lib, step, step.k_cache, step.v_cache, prefill)
    got = attend(lib, step, k, v, prefill)
    assert torch.isfinite(want.float()).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_first_writes_the_step_rows(lib, dtype) -> None:
    """The step's K/V rows written by the call land where the view says (two padding
    rows, slot -1, are skipped), and the call attends to them."""
    step = make_step(*PREFILL, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                     dtype=dtype, num_pad_tokens=2)  # fmt: skip
    m = step.meta
    rows_k, rows_v = step.k_cache.clone(), step.v_cache.clone()
    heads_k, heads_v = heads_first(step.k_cache), heads_first(step.v_cache)
    kw = dict(key=step.key, value=step.value, slot_mapping=m.slot_mapping)
    want = attend(lib, step, rows_k, rows_v, True, **kw)
    got = attend(lib, step, heads_k, heads_v, True, **kw)
    torch.testing.assert_close(heads_k, rows_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(heads_v, rows_v, atol=0, rtol=0, equal_nan=True)
    n = int(m.query_start_loc[-1])
    assert torch.isfinite(got[:n].float()).all()
    assert torch.equal(got[:n], want[:n])


def test_other_strides_are_refused(lib) -> None:
    step = make_step([20], [1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.float32)  # fmt: skip
    padded = torch.zeros(*step.k_cache.shape[:3], 128)[..., :64]
    with pytest.raises(ValueError, match="strides"):
        attend(lib, step, padded, padded, False)
    with pytest.raises(ValueError, match="strides"):  # K and V in different layouts
        attend(lib, step, step.k_cache, heads_first(step.v_cache), False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_heads_first_rounds_float32_rows_into_a_16_bit_cache(lib, dtype) -> None:
    """float32 K/V rows written into a 16-bit heads-first cache (a float32 model with
    ``kv_cache_dtype``): each head's row is rounded where the view puts it, with the
    same bits as into the rows-first cache."""
    step = make_step(*PREFILL, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                     dtype=dtype, num_pad_tokens=2)  # fmt: skip
    m = step.meta
    rows_k, rows_v = step.k_cache.clone(), step.v_cache.clone()
    heads_k, heads_v = heads_first(step.k_cache), heads_first(step.v_cache)
    key = step.key.float() + 1e-3 * torch.randn(step.key.shape)  # not exact in 16 bits
    value = step.value.float() + 1e-3 * torch.randn(step.value.shape)
    kw = dict(key=key, value=value, slot_mapping=m.slot_mapping)
    want = attend(lib, step, rows_k, rows_v, True, **kw)
    got = attend(lib, step, heads_k, heads_v, True, **kw)
    torch.testing.assert_close(heads_k, rows_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(heads_v, rows_v, atol=0, rtol=0, equal_nan=True)
    written = m.slot_mapping[m.slot_mapping >= 0]
    bs = heads_k.shape[1]
    torch.testing.assert_close(heads_k[written // bs, written % bs],
                               key[m.slot_mapping >= 0].to(dtype), atol=0, rtol=0)
    n = int(m.query_start_loc[-1])
    assert torch.equal(got[:n], want[:n])


@pytest.mark.parametrize("layout,block_size,code,message", [
    (abi.KV_HEADS_FIRST + 1, 16, "PA_ERR_LAYOUT", "unknown KV cache layout"),
    (abi.KV_ROWS_FIRST, 0, "PA_ERR_BLOCK_SIZE", "block_size is not positive"),
    (abi.KV_ROWS_FIRST, -16, "PA_ERR_BLOCK_SIZE", "block_size is not positive"),
])
def test_a_bad_layout_code_or_block_size_is_refused(lib, layout, block_size, code,
                                                    message) -> None:
    """The C entry point itself: a layout code other than the two, or a block size below
    one, is refused before anything is written."""
    status = refused_c_call(lib, layout=layout, block_size=block_size)
    assert status == abi.CONSTANTS[code]
    assert abi.ATTENTION_ERRORS[status] == message


def test_allocated_caches_index_alike_in_either_layout() -> None:
    """``allocate_kv_cache`` gives every backend the indexing ``[..., blocks, block_size,
    Hkv, D]``; a heads-first backend's memory holds each KV head's rows of a block as one
    run."""
    shape = (2, 2, 5, 16, 3, 8)
    made: list[tuple[int, ...]] = []

    def zeros(dims: tuple[int, ...]) -> torch.Tensor:
        made.append(dims)
        return torch.zeros(dims)

    for by_heads in (False, True):
        made.clear()
        cache = allocate_kv_cache(shape, by_heads, zeros)
        assert cache.shape == shape
        assert made == [(2, 2, 5, 3, 16, 8) if by_heads else shape]
        assert cache.transpose(-3, -2).is_contiguous() == by_heads
        assert cache.is_contiguous() != by_heads
        cache[1, 0, 4, 15, 2, 7] = 1.0  # the last row of the last head of the last block
        assert cache.untyped_storage().nbytes() == cache.numel() * 4
        assert torch.nonzero(cache).tolist() == [[1, 0, 4, 15, 2, 7]]
