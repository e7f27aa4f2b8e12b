"""The native CPU attention kernel (decode rows and prefill chunks) against the torch
reference, and its errors (its build: test_native_build.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import (
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.synthetic import make_step
from tests.helpers.kernels import NATIVE_TOL as TOL

LENS = [1, 2, 15, 16, 17, 31, 33, 100, 257, 700]


@pytest.fixture
def lib(native_lib):
    """Every build level this CPU runs (conftest's ``native_lib``): the engine's own
    library is one of them."""
    return native_lib


def decode_step(lens, heads, head_dim, block_size, dtype, seed=0):
    step = make_step(lens, [1] * len(lens), num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)  # fmt: skip
    write_kv(step.key, step.value, step.k_cache, step.v_cache, step.meta.slot_mapping)
    return step


def native(lib, step, **kw):
    m = step.meta
    return cpu_native.paged_attention(
        lib, step.query, step.k_cache, step.v_cache, m.block_tables, m.seq_lens,
        max(m.seq_lens_cpu), step.scale, **kw,
    )  # fmt: skip


def reference(step):
    m = step.meta
    return paged_decode_attention(step.query, step.k_cache, step.v_cache, m.block_tables,
                                  m.seq_lens, step.scale)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1), (12, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
# 64 and 128 are the specialised vector paths, 96 the general one; 40 is the scalar loop
# on AVX-512 (not a multiple of 16) and the general vector path on AVX2.
@pytest.mark.parametrize("head_dim", [64, 128, 96, 40])
def test_matches_reference(lib, head_dim, block_size, heads, dtype) -> None:
    # Unused blocks (including block 0, the table padding) hold NaN: any read past a
    # context, or of a padding table entry, poisons the output.
    step = decode_step(LENS, heads, head_dim, block_size, dtype)
    out = native(lib, step)
    assert out.dtype == dtype and out.shape == step.query.shape
    torch.testing.assert_close(out.float(), reference(step).float(), **TOL[dtype])


# (seq_lens, q_lens): whole prompts shorter and longer than the 16-token tile and than a
# block, chunks continuing a cached prefix or an earlier chunk (q_len < seq_len), a
# context of several hundred rows, decodes first, and decodes alone.
PREFILL = [
    ([40], [40]),
    ([1, 17, 300, 5, 64, 16, 33], [1, 1, 300, 5, 17, 16, 1]),
    ([9, 700, 130, 37, 18], [1, 250, 130, 20, 2]),
    ([3, 45, 200], [1, 1, 1]),
]


def prefill_step(case, heads, head_dim, block_size, dtype, seed=0):
    seq_lens, q_lens = case
    step = make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)  # fmt: skip
    write_kv(step.key, step.value, step.k_cache, step.v_cache, step.meta.slot_mapping)
    return step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (12, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 96, 40])
@pytest.mark.parametrize("case", PREFILL)
def test_prefill_chunks_match_reference(lib, case, head_dim, block_size, heads, dtype) -> None:
    """Causal attention of prefill chunks through the cache; NaN in every unused block
    (and past each token's own position in its last block) would poison the output."""
    step = prefill_step(case, heads, head_dim, block_size, dtype)
    m = step.meta
    out = cpu_native.paged_attention(lib, step.query, step.k_cache, step.v_cache,
                                     m.block_tables, m.seq_lens, max(m.seq_lens_cpu),
                                     step.scale, query_start_loc=m.query_start_loc)  # fmt: skip
    expected = paged_prefill_attention(step.query, step.k_cache, step.v_cache, m.block_tables,
                                       m.query_start_loc, m.seq_lens, step.scale)  # fmt: skip
    assert out.dtype == dtype and out.shape == step.query.shape
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


def fused_rows(step):
    """``key``/``value`` as strided views of one fused QKV output row per token."""
    t = step.query.shape[0]
    fused = torch.cat([x.reshape(t, -1) for x in (step.query, step.key, step.value)], dim=1)
    q, k, v = fused.split([step.query[0].numel(), step.key[0].numel(),
                           step.value[0].numel()], dim=1)  # fmt: skip
    return k.view_as(step.key), v.view_as(step.value)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL)
def test_writes_step_rows_then_attends(lib, case, dtype) -> None:
    """The step's K/V rows handed to the call (views of a fused QKV output; two padding
    rows with slot -1) are written before anything is attended: the same cache and the
    same output as writing them first. The step's own slots start as NaN, so a row
    attended before it is written poisons the output."""
    seq_lens, q_lens = case
    step = make_step(seq_lens, q_lens, num_heads=9, num_kv_heads=3, head_dim=64,
                     block_size=16, dtype=dtype, num_pad_tokens=2)  # fmt: skip
    m = step.meta
    key, value = fused_rows(step)
    assert not key.is_contiguous()
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    args = (m.block_tables, m.seq_lens, max(m.seq_lens_cpu), step.scale)
    got = cpu_native.paged_attention(lib, step.query, k_cache, v_cache, *args,
                                     query_start_loc=m.query_start_loc, key=key, value=value,
                                     slot_mapping=m.slot_mapping)  # fmt: skip
    write_kv(step.key, step.value, step.k_cache, step.v_cache, m.slot_mapping)
    expected = cpu_native.paged_attention(lib, step.query, step.k_cache, step.v_cache, *args,
                                          query_start_loc=m.query_start_loc)  # fmt: skip
    assert_same(k_cache, step.k_cache)
    assert_same(v_cache, step.v_cache)
    n = int(m.query_start_loc[-1])
    assert torch.isfinite(got[:n].float()).all()
    assert_same(got[:n], expected[:n])


def test_kv_rows_in_another_dtype_are_converted(lib) -> None:
    step = make_step([5, 40], [1, 40], num_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype=torch.bfloat16)  # fmt: skip
    m = step.meta
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    cpu_native.paged_attention(lib, step.query, k_cache, v_cache, m.block_tables, m.seq_lens,
                               40, step.scale, query_start_loc=m.query_start_loc,
                               key=step.key.float(), value=step.value.float(),
                               slot_mapping=m.slot_mapping)  # fmt: skip
    write_kv(step.key, step.value, step.k_cache, step.v_cache, m.slot_mapping)
    assert_same(k_cache, step.k_cache)
    assert_same(v_cache, step.v_cache)


def test_rejects_bad_kv_rows(lib) -> None:
    """A slot past the cache is refused before anything is written."""
    step = make_step([20, 9], [1, 9], num_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype=torch.float32)  # fmt: skip
    m = step.meta
    args = (lib, step.query, step.k_cache, step.v_cache, m.block_tables, m.seq_lens, 20,
            step.scale)  # fmt: skip
    k_before, v_before = step.k_cache.clone(), step.v_cache.clone()
    slots = m.slot_mapping.clone()
    slots[-1] = step.k_cache.shape[0] * step.k_cache.shape[1]  # one past the last slot
    with pytest.raises(ValueError, match="KV write slot is out of range"):
        cpu_native.paged_attention(*args, query_start_loc=m.query_start_loc, key=step.key,
                                   value=step.value, slot_mapping=slots)  # fmt: skip
    assert_same(step.k_cache, k_before)
    assert_same(step.v_cache, v_before)
    # A request with more query tokens than its context: refused, nothing written.
    bad_qsl = torch.tensor([0, 0, 10], dtype=torch.int32)  # request 1: 10 tokens, context 9
    with pytest.raises(ValueError, match="out of range"):
        cpu_native.paged_attention(*args, query_start_loc=bad_qsl, key=step.key,
                                   value=step.value, slot_mapping=m.slot_mapping)  # fmt: skip
    assert_same(step.k_cache, k_before)
    assert_same(step.v_cache, v_before)
    with pytest.raises(ValueError, match="do not fit the cache rows"):
        cpu_native.paged_attention(*args, query_start_loc=m.query_start_loc,
                                   key=step.key[:, :1], value=step.value[:, :1],
                                   slot_mapping=m.slot_mapping)  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping needs key and value"):
        cpu_native.paged_attention(*args, query_start_loc=m.query_start_loc,
                                   slot_mapping=m.slot_mapping)  # fmt: skip


def test_prefill_tokens_see_only_their_past() -> None:
    """Changing the K/V of a later position changes no earlier token's output."""
    lib = cpu_native.load()
    step = prefill_step(([70], [70]), (6, 2), 64, 16, torch.float32)
    m = step.meta
    args = (lib, step.query, step.k_cache, step.v_cache, m.block_tables, m.seq_lens, 70,
            step.scale)  # fmt: skip
    before = cpu_native.paged_attention(*args, query_start_loc=m.query_start_loc)
    slot = int(m.slot_mapping[40])
    step.k_cache.view(-1, 2, 64)[slot] += 3.0
    step.v_cache.view(-1, 2, 64)[slot] -= 5.0
    after = cpu_native.paged_attention(*args, query_start_loc=m.query_start_loc)
    assert torch.equal(after[:40], before[:40])
    assert not torch.equal(after[40:], before[40:])
    # Every token of a chunk equals the same position attended as a one-token decode.
    lens = torch.arange(1, 71, dtype=torch.int32)
    tables = m.block_tables.expand(70, -1)
    one_by_one = cpu_native.paged_attention(lib, step.query, step.k_cache, step.v_cache,
                                            tables, lens, 70, step.scale)  # fmt: skip
    torch.testing.assert_close(after, one_by_one, atol=2e-6, rtol=2e-6)


def test_large_scores_are_stable(lib) -> None:
    """Scores far from zero (large q.k) still give a finite, exact softmax."""
    step = decode_step([5, 300], (6, 2), 64, 16, torch.float32)
    step.query.mul_(40.0)
    out = native(lib, step)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(step), atol=1e-4, rtol=1e-4)


def test_strided_query_rows(lib) -> None:
    """Query rows taken from a fused QKV output are read in place."""
    step = decode_step([3, 40, 77], (9, 3), 64, 16, torch.float32)
    fused = torch.cat([step.query.reshape(3, -1), torch.randn(3, 2 * 3 * 64)], dim=1)
    view = fused[:, : 9 * 64].view(3, 9, 64)
    assert not view.is_contiguous()
    m = step.meta
    got = cpu_native.paged_attention(lib, view, step.k_cache, step.v_cache,
                                     m.block_tables, m.seq_lens, 77, step.scale)  # fmt: skip
    torch.testing.assert_close(got, reference(step), **TOL[torch.float32])


def test_writes_into_out(lib) -> None:
    step = decode_step([3, 40, 77], (9, 3), 64, 16, torch.float32)
    buf = torch.full((5, 9, 64), 7.0)
    got = native(lib, step, out=buf[1:4])
    assert got.data_ptr() == buf[1:4].data_ptr()
    torch.testing.assert_close(buf[1:4], reference(step), **TOL[torch.float32])
    assert torch.all(buf[0] == 7.0) and torch.all(buf[4] == 7.0)
    # A bfloat16 destination is filled through a float32 buffer.
    bf = torch.zeros(3, 9, 64, dtype=torch.bfloat16)
    native(lib, step, out=bf)
    torch.testing.assert_close(bf, reference(step).to(torch.bfloat16))


def test_rejects_bad_inputs(lib) -> None:
    step = decode_step([20, 9], (4, 2), 64, 16, torch.float32)
    m = step.meta
    args = (lib, step.query, step.k_cache, step.v_cache)
    bad_table = m.block_tables.clone()
    bad_table[1, 0] = step.k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="block id is out of range"):
        cpu_native.paged_attention(*args, bad_table, m.seq_lens, 20, step.scale)
    with pytest.raises(ValueError, match="out of range"):  # a context over max_seq_len
        cpu_native.paged_attention(*args, m.block_tables, m.seq_lens, 10, step.scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cpu_native.paged_attention(lib, step.query[:, :3], step.k_cache, step.v_cache,
                                   m.block_tables, m.seq_lens, 20, step.scale)  # fmt: skip
    with pytest.raises(ValueError, match="unsupported KV cache dtype"):
        cpu_native.paged_attention(lib, step.query, step.k_cache.double(),
                                   step.v_cache.double(), m.block_tables, m.seq_lens,
                                   20, step.scale)  # fmt: skip


def test_threads_do_not_change_results(lib) -> None:
    step = decode_step(LENS * 3, (9, 3), 64, 16, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native(lib, step)
        torch.set_num_threads(max(2, threads))
        many = native(lib, step)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
