"""A 16-bit KV cache under float32 K/V (``kv_cache_dtype``): the native kernel rounds
this step's float32 rows into the cache exactly as torch's ``.to()`` does, at every
build level, and attends to them as if torch had written them."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import write_kv
from pagedserve.kernels.cpu import abi
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.synthetic import make_step

# Values whose rounding differs between careless conversions: ties to even, the largest
# float16 and what rounds past it, subnormals of both formats, underflow, signed zero,
# infinities, NaN.
SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0 + 2.0**-8,
           1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 65504.0,
           65519.0, 65520.0, 1e5, 6e-8, 3e-8, 1e-8, 1e-40, -1e-40, 3.0e38, 1.7e38]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, NaN for NaN (torch's own conversions differ in a NaN's payload
    between its vector and scalar loops)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _step(cache_dtype, q_lens, lens, seed):
    step = make_step(lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=cache_dtype, seed=seed)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    key = torch.randn(step.key.shape, generator=g) * 3
    value = torch.randn(step.value.shape, generator=g) * 3
    special = torch.tensor(SPECIAL)
    key.view(-1)[: special.numel()] = special
    value.view(-1)[-special.numel():] = special
    return step, step.query.to(torch.float32), key, value


def _attend(lib, step, query, k_cache, v_cache, **kw):
    m = step.meta
    return cpu_native.paged_attention(
        lib, query, k_cache, v_cache, m.block_tables, m.seq_lens, max(m.seq_lens_cpu),
        step.scale, query_start_loc=m.query_start_loc, **kw)  # fmt: skip


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,lens", [
    ([1, 1, 1], [1, 40, 700]),         # decodes, one long enough to split
    ([1, 5, 70], [20, 33, 300]),       # a decode, a short chunk, a tiled chunk (rows >= 64)
    ([100], [100]),                    # a whole prompt
])  # fmt: skip
def test_float32_rows_round_into_a_16bit_cache(native_lib, cache_dtype, q_lens, lens):
    step, query, key, value = _step(cache_dtype, q_lens, lens, seed=len(lens))
    slots = step.meta.slot_mapping
    # The kernel writes the float32 rows itself ...
    k_got, v_got = step.k_cache.clone(), step.v_cache.clone()
    got = _attend(native_lib, step, query, k_got, v_got, key=key, value=value,
                  slot_mapping=slots)  # fmt: skip
    # ... and torch rounds them first, the kernel then reading what is cached.
    k_want, v_want = step.k_cache.clone(), step.v_cache.clone()
    write_kv(key.to(cache_dtype), value.to(cache_dtype), k_want, v_want, slots)
    want = _attend(native_lib, step, query, k_want, v_want)
    assert _same(k_got, k_want) and _same(v_got, v_want)
    # Strided rows (views of a fused QKV output) are written the same way.
    k_view, v_view = step.k_cache.clone(), step.v_cache.clone()
    fused = torch.cat([key, value], dim=1)  # [T, 2 * Hkv, D]
    n = key.shape[1]
    _attend(native_lib, step, query, k_view, v_view, key=fused[:, :n], value=fused[:, n:],
            slot_mapping=slots)  # fmt: skip
    assert _same(k_view, k_want) and _same(v_view, v_want)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_rows_of_another_16bit_type_are_refused(native_lib):
    # The C entry point itself (the wrapper converts such rows before the call): float16
    # rows into a bfloat16 cache are refused, and nothing is written.
    step, query, key, value = _step(torch.bfloat16, [1], [5], seed=0)
    m = step.meta
    k_cache = step.k_cache.clone()
    key16, value16 = key.to(torch.float16), value.to(torch.float16)
    out = torch.empty_like(query)
    status = native_lib.paged_attention(
        query.data_ptr(), k_cache.data_ptr(), step.v_cache.data_ptr(),
        cpu_native.DTYPE_CODES[torch.bfloat16], abi.KV_ROWS_FIRST, m.block_tables.data_ptr(),
        m.seq_lens.data_ptr(), None, query.stride(0), out.data_ptr(), 1, 6, 2, 64, 16,
        k_cache.shape[0], m.block_tables.shape[1], 5, step.scale, 0, 0.0, key16.data_ptr(),
        value16.data_ptr(), cpu_native.DTYPE_CODES[torch.float16], key16.stride(0),
        m.slot_mapping.data_ptr(), 1, 1)  # fmt: skip
    assert status == abi.CONSTANTS["PA_ERR_DTYPE"]
    assert torch.equal(_bits(k_cache), _bits(step.k_cache))
