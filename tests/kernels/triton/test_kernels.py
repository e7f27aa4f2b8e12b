"""Triton kernels and TritonBackend against the torch reference.

Without CUDA the kernels run in the Triton interpreter (exact but slow).
``TRITON_INTERPRET`` is read when a function is decorated with ``@triton.jit``, which
for triton's own ``tl`` helpers happens when triton is imported: so it is set here
before triton is imported, and if something imported triton earlier in this pytest
process, this module instead re-runs itself in a subprocess. The grid keeps head
counts small and only a few long contexts, so the module stays within a few minutes
on two cores.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_INTERPRET_SET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
# triton already imported in compiled mode: its tl helpers cannot be interpreted.
RUN_IN_SUBPROCESS = DEVICE == "cpu" and "triton" in sys.modules and not _INTERPRET_SET
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from pagedserve.kernels import KernelSettings, get_attention_backend, torch_ref  # noqa: E402
from pagedserve.kernels.cpu.synthetic import PagedStep, make_step  # noqa: E402
from pagedserve.kernels.quant import FORMATS, StackedWeight  # noqa: E402
from pagedserve.kernels.triton import rope  # noqa: E402
from pagedserve.kernels.triton.backend import TritonLayerOps  # noqa: E402
from pagedserve.kernels.triton.common import dot_block  # noqa: E402
from pagedserve.kernels.triton.decode import (  # noqa: E402
    MAX_SPLITS,
    _decode_kernel,
    choose_num_splits,
    device_num_sms,
)
from pagedserve.kernels.triton.decode import paged_decode_attention as triton_decode  # noqa: E402
from pagedserve.kernels.triton.prefill import paged_prefill_attention as triton_prefill  # noqa: E402
from pagedserve.kernels.triton.quant_matmul import quant_matmul  # noqa: E402
from pagedserve.kernels.triton.write_kv import write_kv as triton_write_kv  # noqa: E402
from tests.helpers.kernels import fused_qkv_views  # noqa: E402
from tests.helpers.quant import assert_product_close, block_k, random_weight  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    # probabilities are rounded to the input dtype before the P @ V product
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
HEADS = [(2, 2), (6, 2), (8, 1)]  # Hq/Hkv = 1, 3, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _step(seq_lens, q_lens, heads, head_dim, block_size, dtype, **kw) -> PagedStep:
    return make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, dtype=dtype, device=DEVICE,
                     **kw)  # fmt: skip


def _written(step: PagedStep) -> PagedStep:
    m = step.meta
    torch_ref.write_kv(step.key, step.value, step.k_cache, step.v_cache, m.slot_mapping)
    return step


def test_in_subprocess() -> None:
    """Run this module where triton is first imported with the interpreter on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_interpreter_is_active() -> None:
    if DEVICE == "cpu":
        assert type(_decode_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv(block_size, dtype) -> None:
    step = _step([3, 40, 17], [1, 25, 17], (6, 3), 64, block_size, dtype, num_pad_tokens=3)
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    m = step.meta
    torch_ref.write_kv(step.key, step.value, k_ref, v_ref, m.slot_mapping)
    triton_write_kv(step.key, step.value, step.k_cache, step.v_cache, m.slot_mapping)
    torch.testing.assert_close(step.k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(step.v_cache, v_ref, atol=0, rtol=0, equal_nan=True)


# Contexts from 1 token to a few blocks, incl. non-multiples of the block size.
DECODE_LENS = [1, 15, 16, 17, 33, 95]


def _check_decode(step: PagedStep, num_splits, dtype, caches=None, **opts) -> None:
    """Against the reference on the step's caches; the kernel reads ``caches`` if given
    (the same rows, NaN where no query looks); ``opts``: ``window``, ``softcap``."""
    m = step.meta
    args = (step.query, step.k_cache, step.v_cache, m.block_tables, m.seq_lens, step.scale)
    expected = torch_ref.paged_decode_attention(*args, **opts)
    if caches is not None:
        args = (step.query, *caches, *args[3:])
    out = triton_decode(*args, num_splits=num_splits, **opts)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_fp32(head_dim, heads, block_size) -> None:
    step = _written(_step(DECODE_LENS, [1] * 6, heads, head_dim, block_size, torch.float32))
    _check_decode(step, 1, torch.float32)  # single pass
    _check_decode(step, 3, torch.float32)  # split-KV: 3 splits + reduce


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
def test_decode_half(heads, dtype) -> None:
    step = _written(_step(DECODE_LENS, [1] * 6, heads, 128, 16, dtype))
    _check_decode(step, 1, dtype)
    _check_decode(step, 2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_long_context_auto_split(dtype) -> None:
    """Long contexts take the automatic split-KV path (splits chosen for the device)."""
    step = _written(_step([700, 1100, 40], [1, 1, 1], (3, 1), 64, 32, dtype))
    assert choose_num_splits(3, 1, 1100, device_num_sms(step.query.device)) > 1
    _check_decode(step, None, dtype)


def test_decode_fixed_splits_over_short_contexts() -> None:
    """A launch sized for a long context (as a graph captured at max_model_len is) over
    short ones: each request splits its own length; splits past it are empty."""
    step = _written(_step([1, 5, 33, 64, 200], [1] * 5, (6, 2), 64, 16, torch.float32))
    _check_decode(step, MAX_SPLITS, torch.float32)


def test_num_splits_fills_the_sms_and_respects_the_limits() -> None:
    assert choose_num_splits(1, 8, 131072, 132) == MAX_SPLITS
    assert choose_num_splits(1, 8, 300, 132) == 2  # no split under MIN_SPLIT_TOKENS on average
    assert choose_num_splits(4, 8, 32768, 132) == 9  # 4 * 8 * 9 >= 2 * 132
    assert choose_num_splits(64, 8, 32768, 132) == 1  # the batch fills the GPU
    assert choose_num_splits(2, 2, 10, 4) == 1


@pytest.mark.parametrize("head_dim", [8, 12])
def test_head_dims_below_16_are_padded(head_dim) -> None:
    """``tl.dot`` needs K >= 16 when compiled (the interpreter does not check it)."""
    assert dot_block(head_dim) == 16
    step = _written(_step([40, 9, 70], [1, 1, 1], (4, 2), head_dim, 16, torch.float32))
    _check_decode(step, 1, torch.float32)
    _check_decode(step, 3, torch.float32)
    _check_prefill(_written(_step([17, 40], [17, 9], (4, 2), head_dim, 16, torch.float32)),
                   torch.float32)


# (seq_len, q_len): first chunks, later chunks, single-token chunks.
PREFILL_CASE = ([17, 100, 64, 37, 20], [17, 40, 64, 5, 1])


def _check_prefill(step: PagedStep, dtype, caches=None, **opts) -> None:
    """As :func:`_check_decode`, for the step's chunks."""
    m = step.meta
    args = (step.query, step.k_cache, step.v_cache, m.block_tables, m.query_start_loc,
            m.seq_lens, step.scale)  # fmt: skip
    expected = torch_ref.paged_prefill_attention(*args, **opts)
    if caches is not None:
        args = (step.query, *caches, *args[3:])
    out = triton_prefill(*args, **opts)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_fp32(head_dim, heads, block_size) -> None:
    seq_lens, q_lens = PREFILL_CASE
    step = _step(seq_lens[::-1], q_lens[::-1], heads, head_dim, block_size, torch.float32,
                 num_pad_tokens=2)  # fmt: skip
    _check_prefill(_written(step), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
def test_prefill_half(heads, dtype) -> None:
    seq_lens, q_lens = PREFILL_CASE
    step = _step(seq_lens[::-1], q_lens[::-1], heads, 128, 32, dtype, num_pad_tokens=2)
    _check_prefill(_written(step), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_long_context(dtype) -> None:
    """A late chunk of a long context and a long first chunk, non-power-of-two heads."""
    step = _step([300, 130], [60, 130], (9, 3), 64, 16, dtype)
    _check_prefill(_written(step), dtype)


MIXED = [
    ([1, 17, 33, 5], [1, 1, 1, 1]),
    ([40, 9], [40, 3]),
    ([7, 100, 16, 64, 37, 130], [1, 1, 1, 64, 20, 50]),
]


@pytest.mark.parametrize(
    "case, dtype, strided",
    [(MIXED[0], torch.float32, False), (MIXED[1], torch.float16, False),
     (MIXED[2], torch.float32, False), (MIXED[2], torch.float16, True)],
)  # fmt: skip
def test_triton_backend_matches_reference(case, dtype, strided) -> None:
    """Mixed steps; ``strided``: query/key/value are views of a fused QKV output."""
    seq_lens, q_lens = case
    step = _step(seq_lens, q_lens, (6, 2), 64, 16, dtype, num_pad_tokens=3)
    m = step.meta
    expected, ref_k, ref_v = _expected_step(step, step.query, step.key)

    q, k, v = fused_qkv_views(step) if strided else (step.query, step.key, step.value)
    backend = get_attention_backend("triton", DEVICE, KernelSettings(triton_interpret=True))
    assert backend.name == "triton"
    backend.prepare(m, step.block_size)
    out = backend.forward(q, k, v, step.k_cache, step.v_cache, m, step.scale)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(step.k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(step.v_cache, ref_v, atol=0, rtol=0, equal_nan=True)


def _expected_step(step: PagedStep, query, key, **opts):
    """The reference output of a mixed step (decodes, then prefill chunks) for these
    query/key rows, and the reference caches with ``key`` and the step's value written."""
    ref_k, ref_v = step.k_cache.clone(), step.v_cache.clone()
    m, nd = step.meta, step.meta.num_decodes
    torch_ref.write_kv(key, step.value, ref_k, ref_v, m.slot_mapping)
    expected = torch.zeros_like(query)
    if nd:
        expected[:nd] = torch_ref.paged_decode_attention(
            query[:nd], ref_k, ref_v, m.block_tables[:nd], m.seq_lens[:nd], step.scale, **opts
        )
    if m.num_reqs > nd:
        pre = torch_ref.paged_prefill_attention(
            query, ref_k, ref_v, m.block_tables[nd:], m.query_start_loc[nd:],
            m.seq_lens[nd:], step.scale, **opts,
        )  # fmt: skip
        expected[m.query_start_loc_cpu[nd] :] = pre[m.query_start_loc_cpu[nd] :]
    return expected, ref_k, ref_v


# Sliding window and soft-capping (``window``/``softcap`` of the torch reference).
# Windows (block size 16): one token, below the block size, not a multiple of it, equal
# to a context (20 and 40 below), longer than every context.
WINDOWS = [1, 5, 20, 40, 200]
SWA_DECODE_LENS = [1, 5, 20, 33, 70]
# Prefill chunks: continuing a cached prefix (the window cuts into it where it is
# shorter than the prefix), first chunks, a single-token chunk; with Hq/Hkv = 3 a
# program takes 16 tokens, so the 25- and 40-token chunks have programs whose window
# starts inside the chunk.
SWA_PREFILL_CASE = ([40, 70, 17, 33, 90], [10, 25, 17, 1, 40])


def _unseen_to_nan(step: PagedStep, first_seen) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the step's caches whose rows of positions ``0 .. first_seen[i] - 1`` of
    request ``i`` (no query of the step looks at them) are NaN: a kernel that loads them
    to mask them returns NaN (0 * NaN in P @ V), one that skips them does not."""
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    bs, (hkv, d) = step.block_size, k_cache.shape[2:]
    tables = step.meta.block_tables.cpu().long()
    for i, n in enumerate(first_seen):
        pos = torch.arange(max(n, 0))
        slots = (tables[i, pos // bs] * bs + pos % bs).to(k_cache.device)
        for cache in (k_cache, v_cache):
            cache.view(-1, hkv, d)[slots] = float("nan")
    return k_cache, v_cache


def _decode_unseen(step: PagedStep, window: int):
    return _unseen_to_nan(step, [s - window for s in step.meta.seq_lens_cpu])


def _prefill_unseen(step: PagedStep, window: int):
    qsl, lens = step.meta.query_start_loc_cpu, step.meta.seq_lens_cpu
    return _unseen_to_nan(step, [s - (b - a) - window + 1
                                 for s, a, b in zip(lens, qsl, qsl[1:], strict=False)])


def _differs(expected: torch.Tensor, *args, ref) -> bool:
    """Whether the reference without these options gives something else (so that a
    kernel ignoring them fails)."""
    return not torch.allclose(ref(*args), expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(6, 2), (8, 1)])
def test_decode_sliding_window(window, heads) -> None:
    """Single pass and split-KV (the splits share the window) against the reference; the
    positions before each window are NaN in the cache the kernel reads (never loaded)."""
    step = _written(_step(SWA_DECODE_LENS, [1] * 5, heads, 64, 16, torch.float32))
    m = step.meta
    args = (step.query, step.k_cache, step.v_cache, m.block_tables, m.seq_lens, step.scale)
    if window < max(SWA_DECODE_LENS):
        expected = torch_ref.paged_decode_attention(*args, window=window)
        assert _differs(expected, *args, ref=torch_ref.paged_decode_attention)
    caches = _decode_unseen(step, window)
    for num_splits in (1, 3, MAX_SPLITS):
        _check_decode(step, num_splits, torch.float32, caches, window=window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(6, 2), (8, 1)])
def test_prefill_sliding_window(window, heads) -> None:
    """Chunks over cached prefixes and first chunks against the reference, the positions
    no query of a request sees NaN in the cache the kernel reads."""
    seq_lens, q_lens = SWA_PREFILL_CASE
    step = _written(_step(seq_lens, q_lens, heads, 64, 16, torch.float32, num_pad_tokens=2))
    m = step.meta
    args = (step.query, step.k_cache, step.v_cache, m.block_tables, m.query_start_loc,
            m.seq_lens, step.scale)  # fmt: skip
    if window < max(seq_lens):
        expected = torch_ref.paged_prefill_attention(*args, window=window)
        assert _differs(expected, *args, ref=torch_ref.paged_prefill_attention)
    _check_prefill(step, torch.float32, _prefill_unseen(step, window), window=window)


def test_decode_sliding_window_auto_split() -> None:
    """Long contexts: the automatic split count is chosen over the window, whose
    positions the splits share."""
    window = 600
    step = _written(_step([700, 1100, 40], [1, 1, 1], (3, 1), 64, 32, torch.float32))
    assert choose_num_splits(3, 1, window, device_num_sms(step.query.device)) > 1
    _check_decode(step, None, torch.float32, _decode_unseen(step, window), window=window)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("window", [0, 20])
def test_softcap(window) -> None:
    """Soft-capped scores, alone and with a window: large scores (the cap bites) and huge
    ones (tanh saturates where its exponential overflows)."""
    softcap = 1.5
    for boost in (4.0, 1000.0):
        dec = _written(_step(SWA_DECODE_LENS, [1] * 5, (6, 2), 64, 16, torch.float32))
        dec.query.mul_(boost)
        m = dec.meta
        args = (dec.query, dec.k_cache, dec.v_cache, m.block_tables, m.seq_lens, dec.scale)
        expected = torch_ref.paged_decode_attention(*args, window=window, softcap=softcap)
        assert _differs(expected, *args, ref=functools.partial(
            torch_ref.paged_decode_attention, window=window))
        for num_splits in (1, 3):
            _check_decode(dec, num_splits, torch.float32, window=window, softcap=softcap)
        seq_lens, q_lens = SWA_PREFILL_CASE
        pre = _written(_step(seq_lens, q_lens, (6, 2), 64, 16, torch.float32))
        pre.query.mul_(boost)
        _check_prefill(pre, torch.float32, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_256_window_and_softcap(dtype) -> None:
    """Gemma 2's shapes (head_dim 256, Hq/Hkv = 2), a window and soft-capping."""
    window, softcap = 20, 2.0
    dec = _written(_step(SWA_DECODE_LENS, [1] * 5, (4, 2), 256, 16, dtype))
    caches = _decode_unseen(dec, window)
    for num_splits in (1, 2):
        _check_decode(dec, num_splits, dtype, caches, window=window, softcap=softcap)
    seq_lens, q_lens = SWA_PREFILL_CASE
    pre = _written(_step(seq_lens, q_lens, (4, 2), 256, 16, dtype))
    _check_prefill(pre, dtype, _prefill_unseen(pre, window), window=window, softcap=softcap)


def _rope_cos_sin(step: PagedStep, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin rows ``[T, 1, D]`` of the step's token positions (padding
    tokens at 0), in the step's dtype."""
    qsl, lens = step.meta.query_start_loc_cpu, step.meta.seq_lens_cpu
    positions = [s - (b - a) + i for s, a, b in zip(lens, qsl, qsl[1:], strict=False)
                 for i in range(b - a)]  # fmt: skip
    positions += [0] * (num_tokens - len(positions))
    d = step.query.shape[2]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return tuple(t.to(step.query.dtype).to(DEVICE) for t in (emb.cos(), emb.sin()))


@pytest.mark.parametrize(
    "window, softcap, dtype", [(20, 0.0, torch.float32), (5, 2.0, torch.float32),
                               (20, 2.0, torch.float16)],
)  # fmt: skip
def test_triton_backend_window_and_softcap(window, softcap, dtype) -> None:
    """``forward`` and ``rope_forward`` of a mixed step (decodes, chunks over cached
    prefixes longer than the window, a first chunk, padding tokens) pass the options to
    both kernels: the reference's output and caches."""
    from pagedserve.kernels.layer_ops import TorchLayerOps

    seq_lens, q_lens = MIXED[2]
    step = _step(seq_lens, q_lens, (6, 2), 64, 16, dtype, num_pad_tokens=3)
    m = step.meta
    opts = dict(window=window, softcap=softcap)
    backend = get_attention_backend("triton", DEVICE, KernelSettings(triton_interpret=True))
    backend.prepare(m, step.block_size)
    expected, ref_k, ref_v = _expected_step(step, step.query, step.key, **opts)
    plain, _, _ = _expected_step(step, step.query, step.key)
    assert not torch.allclose(plain, expected, atol=1e-2, rtol=1e-2)
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    out = backend.forward(step.query, step.key, step.value, k_cache, v_cache, m, step.scale,
                          **opts)  # fmt: skip
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)

    # rope_forward: the rotated query and key as the reference's inputs.
    q, k, v = fused_qkv_views(step)
    cos, sin = _rope_cos_sin(step, q.shape[0])
    assert rope.fusable(q, k, cos, sin) and rope.writes_kv(k, v, step.k_cache, step.v_cache)
    rot_q, rot_k = TorchLayerOps().rope(q.clone(), k.clone(), cos, sin)
    expected, ref_k, _ = _expected_step(step, rot_q, rot_k, **opts)
    out = backend.rope_forward(q, k, v, cos, sin, step.k_cache, step.v_cache, m, step.scale,
                               **opts)  # fmt: skip
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(step.k_cache, ref_k, equal_nan=True, **TOL[dtype])


def test_triton_in_kernels_triton_is_the_pypi_package() -> None:
    """``pagedserve.kernels.triton`` does not shadow the real ``triton`` inside its own modules."""
    from pathlib import Path

    import pagedserve.kernels.triton.decode as decode

    package = Path(decode.__file__).resolve().parent
    assert Path(decode.triton.__file__).resolve().parent != package
    assert hasattr(decode.triton, "jit") and decode.tl.__name__ == "triton.language"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k", "m"), [(70, 96, 5), (33, 64, 17), (128, 320, 1)])
def test_quant_matmul_matches_reference(fmt, n, k, m) -> None:
    """The dequantizing matmul against dequantize-then-matmul: every format, partial
    tiles in M and N, with and without bias, strided rows (the K-quants with as many
    256-wide blocks as the others have 32-wide ones)."""
    k = block_k(fmt, k)
    w = random_weight(fmt, n, k, seed=n + k).to(DEVICE)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    for b in (None, bias):
        out = quant_matmul(x, w, b)
        assert out.shape == (m, n) and out.dtype == x.dtype
        assert_product_close(out.cpu(), x.cpu(), w.to("cpu"), None if b is None else b.cpu())
    wide = torch.randn(m, k + 32, generator=g).to(DEVICE)[:, 16:16 + k]
    assert_product_close(quant_matmul(wide, w).cpu(), wide.cpu(), w.to("cpu"), None)


def test_triton_layer_ops_route_quantized_weights() -> None:
    ops = TritonLayerOps()
    w = random_weight("q4_1", 40, 64, seed=1).to(DEVICE)
    x = torch.randn(3, 64).to(DEVICE)
    assert_product_close(ops.linear(x, w).cpu(), x.cpu(), w.to("cpu"), None)
    odd = random_weight("int8", 8, 45).to(DEVICE)  # K not a multiple of 32: the reference
    xo = torch.randn(2, 45).to(DEVICE)
    assert_product_close(ops.linear(xo, odd).cpu(), xo.cpu(), odd.to("cpu"), None)
    with pytest.raises(ValueError, match="does not match"):
        quant_matmul(torch.randn(2, 32).to(DEVICE), w)
    stacked = StackedWeight((random_weight("q4_k", 24, 256, seed=2),
                             random_weight("q6_k", 8, 256, seed=3))).to(DEVICE)  # fmt: skip
    xs, bias = torch.randn(3, 256).to(DEVICE), torch.randn(32).to(DEVICE)
    assert_product_close(ops.linear(xs, stacked, bias).cpu(), xs.cpu(), stacked.to("cpu"),
                         bias.cpu())  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_fused_norms_match_the_torch_layer_ops(dtype, hidden) -> None:
    """RMSNorm and add + RMSNorm in one Triton launch each equal the torch reference
    (the sum rounded to the dtype, the norm over it in float32), and the add updates the
    residual in place."""
    from pagedserve.kernels.layer_ops import TorchLayerOps

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x, delta = (torch.randn(5, hidden, generator=gen, device=DEVICE).to(dtype) for _ in "xd")
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=DEVICE)).to(dtype)
    ref, ops = TorchLayerOps(), TritonLayerOps()
    tol = TOL[dtype]
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6),
                               **tol)  # fmt: skip
    want_res, want_out = ref.add_rms_norm(x, delta, weight, 1e-6)
    residual = x.clone()
    got_res, got_out = ops.add_rms_norm(residual, delta, weight, 1e-6)
    assert got_res.data_ptr() == residual.data_ptr()
    # Exact in float32; the interpreter rounds float32 to bfloat16 by truncation (compiled
    # code rounds to nearest, as torch does), so bfloat16 sums agree to one unit.
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(got_res, want_res, **exact)
    torch.testing.assert_close(got_out, want_out, **tol)
