"""Helpers of the kernel tests; the synthetic steps themselves are
:mod:`pagedserve.kernels.cpu.synthetic` (the CPU benchmark uses them too)."""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.synthetic import PagedStep

NATIVE_TOL = {
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    # Both sides compute in float32 from the same cached values; the outputs may differ
    # by one unit in the last place of the output dtype.
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=4e-3, rtol=8e-3),
}
"""The native attention kernel against the torch reference, by query dtype."""


def heads_first(cache: torch.Tensor) -> torch.Tensor:
    """The same values, each block's rows of a KV head contiguous (``KV_HEADS_FIRST``,
    seen through a ``transpose(1, 2)`` view)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def fused_qkv_views(step: PagedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query/key/value as strided views of one fused QKV projection output."""
    t, hq, d = step.query.shape
    hkv = step.key.shape[1]
    qkv = torch.cat([step.query.reshape(t, -1), step.key.reshape(t, -1),
                     step.value.reshape(t, -1)], dim=1)  # fmt: skip
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    return q, k, v


def refused_c_call(lib, layout: int | None = None, block_size: int = 16, window: int = 0,
                   softcap: float = 0.0) -> int:
    """The status of a one-decode ``paged_attention`` call made straight to the C entry
    point with these arguments; asserts that it wrote nothing to the caches (a refused
    call writes nothing)."""
    from pagedserve.kernels.cpu import abi
    from pagedserve.kernels.cpu.synthetic import make_step

    step = make_step([5], [1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.float32)  # fmt: skip
    m = step.meta
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    query, key, value = step.query.contiguous(), step.key.contiguous(), step.value.contiguous()
    out = torch.empty_like(query)
    status = lib.paged_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), abi.DTYPE_F32,
        abi.KV_ROWS_FIRST if layout is None else layout, m.block_tables.data_ptr(),
        m.seq_lens.data_ptr(), None, query.stride(0), out.data_ptr(), 1, 4, 2, 64, block_size,
        k_cache.shape[0], m.block_tables.shape[1], 5, step.scale, window, softcap,
        key.data_ptr(), value.data_ptr(), abi.DTYPE_F32, key.stride(0),
        m.slot_mapping.to(torch.int64).data_ptr(), 1, 1)  # fmt: skip
    torch.testing.assert_close(k_cache, step.k_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, step.v_cache, atol=0, rtol=0, equal_nan=True)
    return status


def decodes_as_chunks(step: PagedStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries of a two-decode ``step`` as two chunks of 3 tokens each, the decode's
    token the last of its chunk (the chunk's first two queries zero): ``(query,
    query_start_loc)``, to attend over the same caches and context lengths."""
    query = torch.zeros(6, *step.query.shape[1:])
    query[2], query[5] = step.query[0], step.query[1]
    return query, torch.tensor([0, 3, 6], dtype=torch.int32)


def native_level_params(levels: tuple[str, ...] | None = None, prefix: str = "") -> list:
    """Every native build level of ``levels`` (default all) as a parameter, ``prefix`` +
    its name; the levels this CPU cannot run are skipped, saying so."""
    import pytest

    from pagedserve.kernels.cpu import native

    runnable = native.runnable_levels()
    return [pytest.param(prefix + level, id=prefix + level) if level in runnable else
            pytest.param(prefix + level, id=prefix + level, marks=pytest.mark.skip(
                reason=f"{level} not on this CPU (it runs {', '.join(runnable)})"))
            for level in (native.LEVELS if levels is None else levels)]  # fmt: skip
