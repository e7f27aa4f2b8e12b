"""The native CPU attention kernel with a sliding window (``window``: the query at
position p sees positions p - window + 1 .. p) and soft-capped scores (``softcap``, Gemma
2) against the torch reference, at every build level this CPU runs: the portable
per-token loops, the vector path's one pass (and the parts of a split long context), and
the tiled path of long chunks (vector and portable), under windows of one row, shorter
than a block, not a multiple of it, equal to and longer than the context.

Every case also checks that its options change the reference's result beyond the
tolerance wherever they cut or cap anything, so a kernel that ignored them fails."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from pagedserve.kernels.cpu import abi
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.backend import CpuBackend
from pagedserve.kernels.cpu.synthetic import PagedStep, make_step
from pagedserve.kernels.layer_ops import TorchLayerOps
from tests.helpers.kernels import NATIVE_TOL as TOL
from tests.helpers.kernels import decodes_as_chunks, heads_first, refused_c_call


@pytest.fixture
def lib(native_lib):
    """Every build level this CPU runs (conftest's ``native_lib``)."""
    return native_lib


def written_step(seq_lens, q_lens, heads=(8, 2), head_dim=64, block_size=16,
                 dtype=torch.float32, seed=0, query_scale=1.0) -> PagedStep:  # fmt: skip
    """A synthetic step (NaN in every unused block) with its K/V already in the cache."""
    step = make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)  # fmt: skip
    write_kv(step.key, step.value, step.k_cache, step.v_cache, step.meta.slot_mapping)
    if query_scale != 1.0:  # larger scores, for the soft cap to bend
        step.query.mul_(query_scale)
    return step


def attend(lib, step, prefill: bool, k_cache=None, v_cache=None, **kw) -> torch.Tensor:
    m = step.meta
    return cpu_native.paged_attention(
        lib, step.query, step.k_cache if k_cache is None else k_cache,
        step.v_cache if v_cache is None else v_cache, m.block_tables, m.seq_lens,
        max(m.seq_lens_cpu), step.scale, query_start_loc=m.query_start_loc if prefill else None,
        **kw)  # fmt: skip


def reference(step, prefill: bool, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    m = step.meta
    if prefill:
        return paged_prefill_attention(step.query, step.k_cache, step.v_cache, m.block_tables,
                                       m.query_start_loc, m.seq_lens, step.scale, window=window,
                                       softcap=softcap)  # fmt: skip
    return paged_decode_attention(step.query, step.k_cache, step.v_cache, m.block_tables,
                                  m.seq_lens, step.scale, window=window, softcap=softcap)  # fmt: skip


def tolerance(step, factor: float = 1.0) -> dict:
    """The native tests' tolerance (times ``factor`` in float32); for float32 at head dims
    past 128, twice that: dot products of 256 terms, summed in another order than torch's,
    round a little more (without a window up to 0.65 of the usual tolerance on this
    suite's steps), and a short window averages few V rows, so that rounding shows
    through (up to 1.1 of it)."""
    tol = TOL[step.query.dtype]
    if step.query.dtype != torch.float32:
        return tol
    factor *= 2 if step.query.shape[-1] > 128 else 1
    return {name: factor * value for name, value in tol.items()}


def check(lib, step, prefill: bool, window: int = 0, softcap: float = 0.0,
          tol_factor: float = 1.0) -> torch.Tensor:  # fmt: skip
    """The kernel's rows of the step against the reference's; where the window cuts some
    query's context or the cap applies, the reference without them must differ."""
    n = int(step.meta.query_start_loc[-1])
    got = attend(lib, step, prefill, window=window, softcap=softcap)[:n]
    want = reference(step, prefill, window, softcap)[:n]
    assert got.dtype == step.query.dtype
    assert torch.isfinite(got.float()).all()
    tol = tolerance(step, tol_factor)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if 0 < window < max(step.meta.seq_lens_cpu) or softcap > 0:
        plain = reference(step, prefill)[:n]
        assert not torch.allclose(plain.float(), want.float(), **tol), "options change nothing"
    return got


# Decode contexts within a block, at and across its edges, over several blocks.
DECODE_LENS = [1, 2, 7, 15, 16, 17, 33, 100, 257]
# One row; shorter than a 16-row block; a block; not a multiple of it; equal to one
# context and cutting a longer one; equal to the longest; longer than every context.
WINDOWS = [1, 5, 16, 23, 100, 257, 1000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 64 and 128: the vector path's specialised bodies; 256: Gemma's (the general body); 40:
# the portable loops on AVX-512 (not a multiple of 16), the general vector body on AVX2.
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_windows(lib, window, head_dim, dtype) -> None:
    step = written_step(DECODE_LENS, [1] * len(DECODE_LENS), head_dim=head_dim, dtype=dtype)
    got = check(lib, step, False, window)
    if window == 1:  # each query sees only its own row: its V row, for every head
        m = step.meta
        pos = m.seq_lens.long() - 1
        slots = m.block_tables.long().gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16
        v = step.v_cache.view(-1, *step.v_cache.shape[2:])[slots]
        torch.testing.assert_close(got, v.repeat_interleave(4, dim=1), atol=0, rtol=0)


# (seq_lens, q_lens)
PREFILL = [
    # A whole prompt on the tiled path: a full tile of 32 tokens and part of another.
    ([40], [40]),
    # A decode; a tiled chunk (4 tiles) after a cached prefix of 200 rows, which the
    # windows cut into; a whole prompt of 5 tiles; per-token chunks after cached prefixes
    # of 17 and 16 rows.
    ([9, 300, 130, 37, 18], [1, 100, 130, 20, 2]),
]
PREFILL_WINDOWS = [1, 7, 16, 23, 64, 130, 1000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])
@pytest.mark.parametrize("window", PREFILL_WINDOWS)
@pytest.mark.parametrize("case", PREFILL, ids=["prompt", "chunks"])
def test_prefill_windows(lib, case, window, head_dim, dtype) -> None:
    check(lib, written_step(*case, head_dim=head_dim, dtype=dtype), True, window)


# 8: less than AVX-512's 16-row runs; 24: a block of a full and a partial run (and of the
# tiled path's 16-key runs); 48: three runs.
@pytest.mark.parametrize("block_size", [8, 24, 48])
@pytest.mark.parametrize("window", [5, 23, 40, 100])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_windows_across_block_sizes(lib, prefill, window, block_size) -> None:
    case = PREFILL[1] if prefill else (DECODE_LENS, [1] * len(DECODE_LENS))
    check(lib, written_step(*case, block_size=block_size), prefill, window)


# Query heads a KV head: 1, 2, 3, 4 and 6 (GCHUNK's chunks of 4 and a rest).
@pytest.mark.parametrize("heads", [(4, 4), (8, 4), (6, 2), (8, 2), (12, 2)])
@pytest.mark.parametrize("options", [(23, 0.0), (0, 5.0), (23, 5.0)], ids=str)
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_group_sizes(lib, prefill, options, heads) -> None:
    case = PREFILL[1] if prefill else (DECODE_LENS, [1] * len(DECODE_LENS))
    check(lib, written_step(*case, heads=heads), prefill, *options)


# Contexts split into parts of 512 rows (528 with 48-row blocks) on the vector path.
SPLIT_LENS = [600, 1100, 1500, 2100]
# 50: every context's window lies in its last part (the rest unplanned, the tile not
# split); 300: in 1100's two last parts, cutting the first of them (part 0 unplanned),
# and cutting 600's part 0; 588: 1100's window from row 512, a part's first row; 1000:
# cutting part 0 of 1100, below the first part of 1500 and 2100; 3000: no cut.
SPLIT_WINDOWS = [50, 300, 588, 1000, 3000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("window", SPLIT_WINDOWS)
def test_split_decodes(lib, window, softcap, block_size, dtype) -> None:
    step = written_step(SPLIT_LENS, [1] * len(SPLIT_LENS), block_size=block_size, dtype=dtype)
    check(lib, step, False, window, softcap)


# Short chunks over split contexts (their tokens share the parts, each seeing its own
# window of them) and a tiled chunk at the end of a long context.
SPLIT_CHUNKS = ([1500, 2100, 3000], [3, 20, 64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("window", [1, 23, 300, 600, 1000, 5000])
def test_split_chunks(lib, window, block_size, dtype) -> None:
    check(lib, written_step(*SPLIT_CHUNKS, block_size=block_size, dtype=dtype), True, window)


@pytest.mark.parametrize("head_dim", [256, 40])
@pytest.mark.parametrize("window", [23, 700])
def test_split_and_tiled_at_other_head_dims(lib, window, head_dim) -> None:
    step = written_step([1100, 900, 40], [1, 300, 5], (6, 2), head_dim)
    check(lib, step, True, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 256, 40])
@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("softcap", [1.0, 5.0, 50.0])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_softcap(lib, prefill, softcap, window, head_dim, dtype) -> None:
    """Scores of a few units (a query 3x the usual): a cap of 1 or 5 bends most of them,
    one of 50 only a little. Such scores make the softmax peaked, which shows their
    rounding (cf. test_native's test_large_scores_are_stable): in float32, uncapped or
    capped at 50, up to 1.6x the usual tolerance on this host (3.7x at head_dim 256,
    whose tolerance is already doubled), so four times it here."""
    case = PREFILL[1] if prefill else (DECODE_LENS, [1] * len(DECODE_LENS))
    step = written_step(*case, head_dim=head_dim, dtype=dtype, query_scale=3.0)
    check(lib, step, prefill, window, softcap, tol_factor=4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("options", [(23, 5.0), (300, 0.0)], ids=str)
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_heads_first_layout(lib, prefill, options, head_dim, dtype) -> None:
    """The KV_HEADS_FIRST layout gives the rows-first layout's bits, and the reference's
    values, under both options."""
    case = (PREFILL[1][0] + [1100], PREFILL[1][1] + [40]) if prefill else (
        DECODE_LENS + [1100], [1] * (len(DECODE_LENS) + 1))  # fmt: skip
    step = written_step(*case, head_dim=head_dim, dtype=dtype)
    k, v = heads_first(step.k_cache), heads_first(step.v_cache)
    assert cpu_native.kv_layout(k) == abi.KV_HEADS_FIRST
    window, softcap = options
    rows = check(lib, step, prefill, window, softcap)
    n = int(step.meta.query_start_loc[-1])
    got = attend(lib, step, prefill, k, v, window=window, softcap=softcap)[:n]
    assert torch.equal(got, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    (DECODE_LENS + SPLIT_LENS, [1] * (len(DECODE_LENS) + len(SPLIT_LENS)), False),
    (*PREFILL[1], True),
    (*SPLIT_CHUNKS, True),
], ids=["decodes", "chunks", "split-chunks"])  # fmt: skip
def test_no_options_are_the_plain_kernel(lib, case, dtype) -> None:
    """window=0 and softcap=0 give the bits of a call without them, and so does a
    window no shorter than any context."""
    seq_lens, q_lens, prefill = case
    step = written_step(seq_lens, q_lens, dtype=dtype)
    plain = attend(lib, step, prefill)
    assert torch.equal(attend(lib, step, prefill, window=0, softcap=0.0), plain)
    assert torch.equal(attend(lib, step, prefill, window=max(seq_lens)), plain)
    assert torch.equal(attend(lib, step, prefill, window=2**40), plain)


def test_window_results_do_not_depend_on_batching(lib) -> None:
    """Under a window, a decode of a split context has the bits of the same position in
    a short chunk (whose first token's window reaches a part lower down), on one thread
    or many; each token of a short chunk has the bits of its position as a decode."""
    lens, window = [1500, 2100], 700
    decode = written_step(lens, [1, 1], (9, 3))
    alone = attend(lib, decode, False, window=window)
    m = decode.meta
    query, qsl = decodes_as_chunks(decode)
    chunk = cpu_native.paged_attention(lib, query, decode.k_cache, decode.v_cache,
                                       m.block_tables, m.seq_lens, max(lens), decode.scale,
                                       query_start_loc=qsl, window=window)  # fmt: skip
    assert torch.equal(chunk[2], alone[0]) and torch.equal(chunk[5], alone[1])
    mixed = written_step(lens + [5, 40], [1, 1, 1, 1], (9, 3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(lib, mixed, False, window=window, softcap=5.0)
        torch.set_num_threads(max(2, threads))
        many = attend(lib, mixed, False, window=window, softcap=5.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    # A 20-token chunk (the per-token sweeps) against its positions as decodes.
    step = written_step([1100], [20], (6, 2))
    chunk = attend(lib, step, True, window=23, softcap=5.0)
    lens = torch.arange(1081, 1101, dtype=torch.int32)
    decodes = cpu_native.paged_attention(lib, step.query, step.k_cache, step.v_cache,
                                         step.meta.block_tables.expand(20, -1), lens, 1100,
                                         step.scale, window=23, softcap=5.0)  # fmt: skip
    assert torch.equal(chunk, decodes)


MIXED = [
    ([1, 17, 33, 5], [1, 1, 1, 1]),  # decodes only (no query_start_loc in the plan)
    ([7, 100, 1100, 37, 130], [1, 1, 64, 20, 50]),  # decodes, then chunks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [(0, 0.0), (23, 0.0), (0, 5.0), (23, 5.0), (700, 0.0)],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("case", MIXED, ids=["decodes", "mixed"])
def test_backend_forward(lib, case, options, dtype) -> None:
    """CpuBackend.forward through AttentionMetadata: this step's K/V written by the
    call (their slots start as NaN), then attended under the options; padding rows are
    zero."""
    window, softcap = options
    step = make_step(*case, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=dtype, num_pad_tokens=2)  # fmt: skip
    m = step.meta
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    write_kv(step.key, step.value, k_ref, v_ref, m.slot_mapping)
    want = paged_prefill_attention(step.query, k_ref, v_ref, m.block_tables, m.query_start_loc,
                                   m.seq_lens, step.scale, window=window, softcap=softcap)  # fmt: skip
    backend = CpuBackend(lib, TorchLayerOps(), fuse_layers=False)
    backend.prepare(m, step.block_size)
    kw = {} if options == (0, 0.0) else dict(window=window, softcap=softcap)
    out = backend.forward(step.query, step.key, step.value, step.k_cache, step.v_cache, m,
                          step.scale, **kw)  # fmt: skip
    n = m.query_start_loc_cpu[-1]
    assert out.shape == step.query.shape and out.dtype == dtype
    torch.testing.assert_close(out[:n].float(), want[:n].float(), **TOL[dtype])
    assert torch.all(out[n:] == 0)
    torch.testing.assert_close(step.k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    if 0 < window < max(m.seq_lens_cpu) or softcap > 0:
        plain = paged_prefill_attention(step.query, k_ref, v_ref, m.block_tables,
                                        m.query_start_loc, m.seq_lens, step.scale)  # fmt: skip
        assert not torch.allclose(plain[:n].float(), want[:n].float(), **TOL[dtype])


BAD_OPTIONS = [
    (dict(window=-1), "window"),
    (dict(window=1.5), "window"),
    (dict(window=True), "window"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softcap=1e39), "softcap"),  # no float32
    (dict(softcap="5"), "softcap"),
]


@pytest.mark.parametrize("bad,name", BAD_OPTIONS, ids=[str(b) for b, _ in BAD_OPTIONS])
def test_bad_options_are_refused(lib, bad, name) -> None:
    step = written_step([20, 9], [1, 1])
    with pytest.raises(ValueError, match=name):
        attend(lib, step, False, **bad)
    backend = CpuBackend(lib, TorchLayerOps(), fuse_layers=False)
    backend.prepare(step.meta, step.block_size)
    with pytest.raises(ValueError, match=name):
        backend.forward(step.query, step.key, step.value, step.k_cache, step.v_cache,
                        step.meta, step.scale, **bad)  # fmt: skip


@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (0, -1.0), (0, float("nan")),
                                            (0, float("inf"))])  # fmt: skip
def test_c_entry_point_refuses_bad_options(lib, window, softcap) -> None:
    """The C entry point itself: a negative window, a negative or non-finite cap are
    refused before anything is written."""
    status = refused_c_call(lib, window=window, softcap=softcap)
    assert status == abi.CONSTANTS["PA_ERR_WINDOW"]
    assert "window" in abi.ATTENTION_ERRORS[status]
