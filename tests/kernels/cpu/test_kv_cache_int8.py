"""An 8-bit KV cache (``kv_cache_dtype="int8"``): each KV head's row is ``head_dim`` int8
codes and their float32 scale. The native kernel quantizes this step's float32 rows into
it with the bits of :func:`~pagedserve.kernels.torch_ref.quantize_kv_rows`, in either
layout, and every attention path (decodes, split long contexts, short chunks, tiles,
windows, soft caps; vector and portable) reads it as the torch reference reads the
dequantized rows, at every build level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import abi
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.synthetic import make_step
from pagedserve.kernels.interface import KV_INT8_SCALE_BYTES, kv_row_width
from tests.helpers.kernels import heads_first

DECODES = ([1, 15, 17, 100, 700], [1] * 5)
"""Decode contexts: within a block, across blocks, and split among threads (700)."""
PREFILL = ([9, 700, 130, 37, 18], [1, 250, 130, 20, 2])
"""A decode, long chunks (the tiled path) continuing a cached prefix, short chunks."""


def test_the_python_constants_are_the_headers() -> None:
    assert KV_INT8_SCALE_BYTES == abi.KV_I8_SCALE_BYTES
    assert cpu_native.DTYPE_CODES[torch.int8] == abi.DTYPE_I8
    assert kv_row_width(64, torch.int8) == 68 and kv_row_width(64, torch.float32) == 64


def test_quantized_rows_round_trip_within_half_a_step() -> None:
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7] = 0.0  # a zero row: scale 0, codes 0
    rows = torch_ref.quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + KV_INT8_SCALE_BYTES)
    back = torch_ref.dequantize_kv_rows(rows)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step * 0.5001 + 1e-30)
    assert torch.equal(back[7], torch.zeros(3, 64))
    assert rows[..., :64].abs().max() == 127  # each nonzero row's largest value is +-127


def _filled(step):
    """The step's float32 caches with its own K/V rows written."""
    k, v = step.k_cache.clone(), step.v_cache.clone()
    torch_ref.write_kv(step.key, step.value, k, v, step.meta.slot_mapping)
    return k, v


def _int8_caches(step, layout_heads_first: bool):
    """The step's float32 caches (its own rows written) quantized; rows outside every
    context (NaN in the float cache) get a NaN scale, so any read of them poisons the
    output."""
    out = []
    for cache in _filled(step):
        rows = torch_ref.quantize_kv_rows(cache)
        unused = cache.isnan().any(-1)
        scale = rows[..., -KV_INT8_SCALE_BYTES:].contiguous().view(torch.float32)
        scale[unused] = float("nan")
        rows[..., -KV_INT8_SCALE_BYTES:] = scale.view(torch.int8)
        out.append(heads_first(rows) if layout_heads_first else rows)
    return out


def _attend(lib, step, k_cache, v_cache, prefill, **kw):
    m = step.meta
    return cpu_native.paged_attention(
        lib, step.query, k_cache, v_cache, m.block_tables, m.seq_lens, max(m.seq_lens_cpu),
        step.scale, query_start_loc=m.query_start_loc if prefill else None, **kw)  # fmt: skip


def _reference(step, k_cache, v_cache, prefill, window=0, softcap=0.0):
    m = step.meta
    if prefill:
        return torch_ref.paged_prefill_attention(
            step.query, k_cache, v_cache, m.block_tables, m.query_start_loc, m.seq_lens,
            step.scale, window=window, softcap=softcap)  # fmt: skip
    return torch_ref.paged_decode_attention(step.query, k_cache, v_cache, m.block_tables,
                                            m.seq_lens, step.scale, window=window,
                                            softcap=softcap)  # fmt: skip


@pytest.mark.parametrize("layout", ["rows_first", "heads_first"])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
# 64 and 128: the specialised vector paths; 96 the general one; 40 the scalar loops on
# AVX-512 and the general vector path on AVX2.
@pytest.mark.parametrize("head_dim", [64, 128, 96, 40])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_attention_reads_the_int8_cache_as_the_reference(native_lib, prefill, head_dim, heads,
                                                         layout):
    seq_lens, q_lens = PREFILL if prefill else DECODES
    step = make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=16, seed=head_dim)  # fmt: skip
    k8, v8 = _int8_caches(step, layout == "heads_first")
    got = _attend(native_lib, step, k8, v8, prefill)
    want = _reference(step, k8.contiguous(), v8.contiguous(), prefill)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # Against the float32 cache it was made from: close, as 8 bits allow.
    exact = _reference(step, *_filled(step), prefill)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("window,softcap", [(40, 0.0), (0, 5.0), (100, 30.0)])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_windows_and_soft_caps_over_an_int8_cache(native_lib, prefill, window, softcap):
    seq_lens, q_lens = PREFILL if prefill else DECODES
    step = make_step(seq_lens, q_lens, num_heads=9, num_kv_heads=3, head_dim=64,
                     block_size=16, seed=window)  # fmt: skip
    k8, v8 = _int8_caches(step, True)
    got = _attend(native_lib, step, k8, v8, prefill, window=window, softcap=softcap)
    want = _reference(step, k8.contiguous(), v8.contiguous(), prefill, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", ["rows_first", "heads_first"])
@pytest.mark.parametrize("q_lens,lens", [
    ([1, 1, 1], [1, 40, 700]),         # decodes, one long enough to split
    ([1, 5, 70], [20, 33, 300]),       # a decode, a short chunk, a tiled chunk
])  # fmt: skip
def test_the_kernel_quantizes_rows_as_the_reference(native_lib, q_lens, lens, layout):
    step = make_step(lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                     seed=len(lens))  # fmt: skip
    g = torch.Generator().manual_seed(3)
    magnitudes = torch.logspace(-4, 4, step.key.shape[0])[:, None, None]
    key = torch.randn(step.key.shape, generator=g) * magnitudes
    value = torch.randn(step.value.shape, generator=g) * 3
    key[0, 1] = 0.0  # a zero row
    value[1, 0, 5] = float("nan")  # a NaN value: code 0, the row's scale from the rest
    value[2, 1, :] = 0.5 * (2 * torch.arange(64) - 63) / 63  # ties at every half step
    k_got, v_got = _int8_caches(step, layout == "heads_first")
    k_want, v_want = k_got.clone(), v_got.clone()
    slots = step.meta.slot_mapping
    got = _attend(native_lib, step, k_got, v_got, True, key=key, value=value,
                  slot_mapping=slots)  # fmt: skip
    torch_ref.write_kv(key, value, k_want, v_want, slots)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    # Strided rows (views of a fused QKV output) are written the same way.
    k_view, v_view = _int8_caches(step, layout == "heads_first")
    fused = torch.cat([key, value], dim=1)
    n = key.shape[1]
    _attend(native_lib, step, k_view, v_view, True, key=fused[:, :n], value=fused[:, n:],
            slot_mapping=slots)  # fmt: skip
    assert torch.equal(k_view, k_want) and torch.equal(v_view, v_want)
    # bfloat16 rows are widened to float32 by the wrapper, then quantized the same way.
    k_bf, v_bf = _int8_caches(step, layout == "heads_first")
    _attend(native_lib, step, k_bf, v_bf, True, key=key.bfloat16(), value=value.bfloat16(),
            slot_mapping=slots)  # fmt: skip
    k_ref, v_ref = _int8_caches(step, layout == "heads_first")
    torch_ref.write_kv(key.bfloat16().float(), value.bfloat16().float(), k_ref, v_ref, slots)
    assert torch.equal(k_bf, k_ref) and torch.equal(v_bf, v_ref)
    # Reading back what was written: the output is the reference's over that cache.
    want = _reference(step, k_want.contiguous(), v_want.contiguous(), True)
    nan = want.isnan()
    torch.testing.assert_close(got[~nan], want[~nan], atol=2e-5, rtol=1e-4)


def test_the_c_call_refuses_rows_that_are_not_float32(native_lib):
    step = make_step([5], [1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    m = step.meta
    k8, v8 = _int8_caches(step, False)
    before = k8.clone()
    key = step.key.to(torch.int8)
    out = torch.empty_like(step.query)
    status = native_lib.paged_attention(
        step.query.data_ptr(), k8.data_ptr(), v8.data_ptr(), abi.DTYPE_I8, abi.KV_ROWS_FIRST,
        m.block_tables.data_ptr(), m.seq_lens.data_ptr(), None, step.query.stride(0),
        out.data_ptr(), 1, 6, 2, 64, 16, k8.shape[0], m.block_tables.shape[1], 5, step.scale,
        0, 0.0, key.data_ptr(), key.data_ptr(), abi.DTYPE_I8, key.stride(0),
        m.slot_mapping.data_ptr(), 1, 1)  # fmt: skip
    assert status == abi.CONSTANTS["PA_ERR_DTYPE"]
    assert torch.equal(k8, before)


def test_a_cache_without_room_for_the_scales_is_refused(native_lib):
    step = make_step([5], [1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    k8 = torch.zeros(step.k_cache.shape, dtype=torch.int8)  # 64 bytes a row: no scale
    with pytest.raises(ValueError, match="cache shapes"):
        _attend(native_lib, step, k8, k8.clone(), False)
