"""Native fused layer ops against the torch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.layer_ops import NativeLayerOps
from pagedserve.kernels.layer_ops import TorchLayerOps, apply_rope, rms_norm
from tests.helpers.kernels import native_level_params


@pytest.fixture
def native(native_lib) -> NativeLayerOps:
    """The ops of every build level this CPU runs (the engine's is one of them)."""
    return NativeLayerOps(native_lib)


REF = TorchLayerOps()
# Rows of a decode step and of a prefill chunk large enough to split across threads.
ROWS = [1, 7, 64, 600]


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [576, 64, 100])
def test_rms_norm(native, rows, dim) -> None:
    x, w = randn(rows, dim, scale=3.0), randn(dim, seed=1)
    before = x.clone()
    out = native.rms_norm(x, w, 1e-5)
    assert torch.equal(x, before)  # the input is only read
    # Only the sum of squares is accumulated in another order: a few ulp.
    torch.testing.assert_close(out, rms_norm(x, w, 1e-5), atol=1e-6, rtol=4e-7)


@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_updates_residual_in_place(native, rows) -> None:
    residual, delta, w = randn(rows, 576), randn(rows, 576, seed=2), randn(576, seed=3)
    expected_res, expected = REF.add_rms_norm(residual.clone(), delta, w, 1e-6)
    res, out = native.add_rms_norm(residual, delta, w, 1e-6)
    assert res.data_ptr() == residual.data_ptr()
    assert torch.equal(res, expected_res)  # the add itself is exact
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=4e-7)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (2, 1, 32)])
def test_rope_in_place_on_fused_qkv_views_is_bit_exact(native, rows, heads) -> None:
    hq, hkv, d = heads
    qkv = randn(rows, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    angles = randn(rows, 1, d, seed=4, scale=10.0)
    cos, sin = angles.cos(), angles.sin()
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got_q, got_k = native.rope(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # V untouched


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(native, rows) -> None:
    gate_up = randn(rows, 2 * 1536, scale=4.0)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp over- and underflow
    out = native.silu_mul(gate_up)
    torch.testing.assert_close(out, REF.silu_mul(gate_up), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 6912, 23])
def test_gelu_tanh_mul(native, rows, inter) -> None:
    gate_up = randn(rows, 2 * inter, scale=4.0)
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -1e20, 1e20])  # exp and x^3 overflow
    out = native.gelu_tanh_mul(gate_up)
    # Against the float64 function: as x sigmoid(2y), the tails keep their relative
    # precision, which torch's 0.5 x (1 + tanh(y)) loses to the cancellation in 1 + tanh.
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out.double(), exact, atol=1e-6, rtol=4e-6)
    bf = gate_up.bfloat16()  # no bfloat16 kernel: torch's, bit for bit
    assert torch.equal(native.gelu_tanh_mul(bf), REF.gelu_tanh_mul(bf))


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("cols", [1, 15, 16, 17, 49152])
def test_argmax(native, rows, cols) -> None:
    x = randn(rows, cols + 5)[:, :cols]  # a column slice, as padded logits are
    assert torch.equal(native.argmax(x), x.argmax(dim=-1))
    # Ties take the first index; a NaN is the largest value (the first NaN wins); a row
    # of -inf gives 0: all as torch.
    x = torch.zeros(rows, cols)
    if cols > 2:
        x[0, 1] = x[0, cols - 1] = 5.0
    if rows > 1 and cols > 2:
        x[1, cols - 1] = float("nan")
        x[1, cols - 2] = float("nan")
        x[1, 0] = float("inf")
    if rows > 2:
        x[2] = float("-inf")
    assert torch.equal(native.argmax(x), x.argmax(dim=-1))


def test_argmax_in_the_sampler_equals_torch(native) -> None:
    from pagedserve.engine.core.sampling_params import SamplingParams
    from pagedserve.engine.sample.sampler import Sampler, SamplingRow

    logits = randn(16, 1000)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(16)]
    got = Sampler(999, argmax=native.argmax)(logits, rows).token_ids
    assert got == logits[:, :999].argmax(dim=-1).tolist()


BF16_ULP = dict(atol=0.0, rtol=2**-7)  # one bfloat16 unit in the last place


@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_norms(native, rows) -> None:
    residual = randn(rows, 576, scale=3.0).bfloat16()
    delta, w = randn(rows, 576, seed=2).bfloat16(), randn(576, seed=3).bfloat16()
    expected_res, expected = REF.add_rms_norm(residual.clone(), delta, w, 1e-5)
    res, out = native.add_rms_norm(residual, delta, w, 1e-5)
    assert res.data_ptr() == residual.data_ptr() and out.dtype == torch.bfloat16
    assert torch.equal(res, expected_res)  # the add is rounded as torch rounds it
    # The float32 sum of squares is accumulated in another order (the order depends on
    # the build's vector width): a rounding boundary may fall between the two, so the
    # normalised value may differ by one bfloat16 ulp, which the product with the
    # weight rounds again (two ulps of the output at most).
    torch.testing.assert_close(out, expected, atol=0.0, rtol=2**-6)
    assert (out != expected).float().mean() < 0.01
    torch.testing.assert_close(native.rms_norm(res, w, 1e-5), rms_norm(res, w, 1e-5),
                               atol=0.0, rtol=2**-6)


@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_rope_is_bit_exact(native, rows) -> None:
    qkv = randn(rows, 15 * 64).bfloat16()
    q, k = qkv[:, : 9 * 64].view(rows, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(rows, 3, 64)
    angles = randn(rows, 1, 64, seed=4, scale=10.0)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got_q, got_k = native.rope(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)


@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_silu_mul(native, rows) -> None:
    gate_up = randn(rows, 2 * 1536 + 2, scale=4.0)[:, 1:-1].contiguous().bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out, expected = native.silu_mul(gate_up), REF.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16
    # exp is capped below overflow, so silu(-100) is about -6e-37 instead of -4e-42.
    torch.testing.assert_close(out, expected, atol=1e-30, rtol=2**-7)
    assert (out != expected).float().mean() < 0.01


def test_other_dtypes_and_layouts_fall_back_to_torch(native) -> None:
    x, w = randn(5, 64).half(), randn(64, seed=1).half()
    assert torch.equal(native.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    x, w = randn(5, 64).bfloat16(), randn(64, seed=1)  # mixed dtypes
    assert torch.equal(native.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    strided = randn(5, 128)[:, ::2]
    assert torch.equal(native.rms_norm(strided, randn(64), 1e-5), rms_norm(strided, randn(64), 1e-5))
    gu = randn(3, 64).double()
    assert torch.equal(native.silu_mul(gu), REF.silu_mul(gu))
    q, k = randn(3, 2, 16).half(), randn(3, 1, 16).half()
    cos, sin = randn(3, 1, 16).half(), randn(3, 1, 16, seed=5).half()
    got = native.rope(q.clone(), k.clone(), cos, sin)
    assert torch.equal(got[0], apply_rope(q, cos, sin)) and torch.equal(got[1], apply_rope(k, cos, sin))
    # A head wider than the kernel's stack buffer takes the torch expression too.
    q, k = randn(2, 1, 1024), randn(2, 1, 1024, seed=1)
    cos, sin = randn(2, 1, 1024, seed=2), randn(2, 1, 1024, seed=3)
    got = native.rope(q.clone(), k.clone(), cos, sin)
    assert torch.equal(got[0], apply_rope(q, cos, sin)) and torch.equal(got[1], apply_rope(k, cos, sin))
    logits = randn(4, 10).bfloat16()
    assert torch.equal(native.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(native.argmax(randn(4, 10)[:, ::2]), randn(4, 10)[:, ::2].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 300, 1500])
def test_linear_with_packed_weights(native, rows, dtype) -> None:
    from pagedserve.kernels.cpu.layer_ops import NATIVE_LINEAR_ROWS

    w, b = randn(96, 64).to(dtype), randn(96, seed=6).to(dtype)
    x = randn(rows, 64, seed=7).to(dtype)
    native.prepare_weights([w])
    paths = native.paths()
    # Every vector build has the native float32 linear; oneDNN packs bfloat16 weights
    # only where torch says it has a bfloat16 path on this CPU.
    assert native._gemm == (cpu_native.isa(native._lib) != "portable")
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert paths["linear_bf16"] == ("onednn-packed" if onednn_bf16 else "torch")
    native_linear = dtype == torch.float32 and native._gemm
    # The native float32 linear takes every row count on AVX-512 builds; past 256 rows
    # AVX2 builds take oneDNN's packed weights (measured faster there).
    level = cpu_native.isa(native._lib)
    assert native.native_max_rows == NATIVE_LINEAR_ROWS.get(level, 256)
    assert native.native_max_rows == (None if level == "avx512" else 256)
    packed_above = native_linear and level == "avx2" and torch.backends.mkldnn.is_available()
    limit = native.native_max_rows or rows
    if native_linear:
        assert paths["linear_f32"].startswith(f"native-{level}")
        assert hasattr(w, "_pagedserve_native_packed")
        assert hasattr(w, "_pagedserve_packed") == packed_above
        assert paths["linear_f32"].endswith(
            "(every row count)" if level == "avx512"
            else "onednn-packed above" if packed_above else "torch above")
    elif dtype == torch.float32 and torch.backends.mkldnn.is_available() or onednn_bf16:
        assert hasattr(w, "_pagedserve_packed")
    else:
        assert not hasattr(w, "_pagedserve_packed")
    tol = dict(atol=3e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native.linear(x, w, b), F.linear(x, w, b), **tol)
    if native_linear and rows > limit and not packed_above:
        assert torch.equal(native.linear(x, w, b), F.linear(x, w, b))  # F.linear itself
    if native_linear and rows <= limit:
        # The native linear's rows do not depend on one another: the batch's last row
        # alone gives the same bits.
        assert torch.equal(native.linear(x, w, b)[-1:], native.linear(x[-1:], w, b))
    # An in-place weight update is seen: the packed copy is rebuilt.
    w.mul_(2)
    tol = dict(atol=6e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(native.linear(x, w), F.linear(x, w), **tol)


def test_fma_peak_is_measured_by_vector_builds_only(native) -> None:
    """The multiply-add peak that ``bench throughput`` divides a workload's matrix
    products by: a rate from each vector build, none from the portable one."""
    for threads in (1, 2):
        peak = native.fma_peak_gflops(threads)
        if native.isa == "portable":
            assert peak is None
        else:
            assert peak is not None and 0 < peak < float("inf")


VECTOR_LEVELS = native_level_params(tuple(lv for lv in cpu_native.LEVELS if lv != "portable"))


@pytest.fixture(scope="module", params=VECTOR_LEVELS)
def gemm(request) -> NativeLayerOps:
    """The native float32 linear of each vector build this CPU runs (the portable build
    has none: it keeps torch's linear)."""
    ops = NativeLayerOps(cpu_native.build_library(request.param))
    assert ops._gemm
    return ops


def linear_f64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


# Row counts around the 6- and 8-row tiles and the 128-row block; widths around the 16-
# and 48-column panels; k odd, small and large; weights big enough to split across
# threads and not.
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 13, 63, 64, 129, 256])
@pytest.mark.parametrize("n,k", [(96, 64), (1, 3), (15, 8), (17, 40), (47, 33), (49, 576),
                                 (960, 576), (576, 1536)])
def test_native_linear_matches_float64(gemm, rows, n, k) -> None:
    w, b = randn(n, k, scale=k**-0.5), randn(n, seed=1)
    x = randn(rows, k, seed=2)
    for bias in (None, b):
        got = gemm.linear(x, w, bias)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        want = linear_f64(x, w, bias)
        # One float32 multiply-add chain per output: error ~ k ulps of the partial sums.
        torch.testing.assert_close(got.double(), want, atol=2e-6 * k**0.5, rtol=1e-5)


def test_native_linear_is_batch_invariant(gemm) -> None:
    """A row's output has the same bits whatever rows share its batch and wherever it
    sits in them (tiles of 6 or 8, blocks of 128, the tail tile)."""
    w, b = randn(200, 576, scale=0.05), randn(200, seed=3)
    x = randn(150, 576, seed=4)
    alone = torch.cat([gemm.linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
    assert torch.equal(gemm.linear(x, w, b), alone)
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(5))
    assert torch.equal(gemm.linear(x[perm], w, b), alone[perm])
    for size in (3, 13, 64):
        assert torch.equal(gemm.linear(x[:size], w, b), alone[:size])


def test_native_linear_on_strided_rows_and_fallbacks(gemm) -> None:
    w = randn(100, 64)
    wide = randn(10, 192, seed=1)
    x = wide[:, 64:128]  # rows strided by 192: read in place
    assert x.stride() == (192, 1)
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    # Column-strided input, a 3-D input, an empty batch and a bfloat16 bias take torch.
    xt = randn(64, 10, seed=2).t()
    assert torch.equal(gemm.linear(xt, w), F.linear(xt, w))
    x3 = randn(2, 5, 64, seed=3)
    assert torch.equal(gemm.linear(x3, w), F.linear(x3, w))
    assert gemm.linear(randn(0, 64), w).shape == (0, 100)
    bb = randn(100, seed=4).bfloat16()
    assert not gemm._use_native(randn(4, 64), w, bb)


# Gate widths around the 24- (AVX-512) and 8-column (AVX2) halves of a pair panel; rows
# around the tiles and the 128-row block (up to 256: AVX2 builds take oneDNN past them).
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 129, 256])
@pytest.mark.parametrize("inter,k", [(1536, 576), (23, 33), (24, 8), (8, 100), (100, 64)])
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_linear_in_pairs_gives_the_bits_of_the_product_then_its_gate(
        gemm, rows, inter, k, gelu) -> None:
    """A gate/up weight packed in pairs: its gate from the product's epilogue has the bits
    of the plain product followed by the gate kernel, and its plain product the bits of
    the plain panels' (the one path for an adapter's product), bias or none."""
    w, b = randn(2 * inter, k, scale=k**-0.5), randn(2 * inter, seed=1)
    plain = w.clone()
    x = randn(rows, k, seed=2)
    gate = gemm.gelu_tanh_mul if gelu else gemm.silu_mul
    for bias in (None, b):
        got = gemm.gated_linear(x, w, bias, gelu)
        assert gemm.native_pair(w) and not gemm.native_pair(plain)
        assert torch.equal(got, gate(gemm.linear(x, plain, bias)))
        assert torch.equal(gemm.linear(x, w, bias), gemm.linear(x, plain, bias))
    assert torch.equal(gemm.gated_linear(x, plain, b, gelu), got)  # plain panels: apart
    assert not gemm.native_pair(plain)


def test_gated_linear_elsewhere_is_the_product_then_its_gate(native) -> None:
    """Where the native linear does not take the weight (the portable build, bfloat16, an
    odd row count), the product then the gate; torch's ops do the same."""
    x, w = randn(5, 64), randn(2 * 40, 64, seed=1)
    for ops in (native, TorchLayerOps()):
        assert torch.equal(ops.gated_linear(x, w, None, False), ops.silu_mul(ops.linear(x, w)))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(native.gated_linear(xb, wb, None, True),
                       native.gelu_tanh_mul(native.linear(xb, wb)))
    odd = randn(41, 64, seed=2)
    assert native.gated_linear(x, odd, None, False).shape == (5, 20)
    assert not native.native_pair(odd)


def test_prepare_weights_packs_gated_weights_in_pairs(gemm) -> None:
    ws = [randn(96, 64), randn(2 * 40, 64, seed=1)]
    gemm.prepare_weights(ws, gated=[ws[1], randn(8, 64).bfloat16()])
    assert [gemm.native_pair(w) for w in ws] == [False, True]
    assert ws[1]._pagedserve_native_packed[1].numel() == gemm._lib.gemm_f32_pair_packed_size(40, 64)
    x = randn(3, 64, seed=2)
    assert torch.equal(gemm.gated_linear(x, ws[1], None, False),
                       gemm.silu_mul(gemm.linear(x, ws[1].clone())))
    # A weight packed plain by its first use keeps its panels (a fused call may hold them).
    used = randn(2 * 40, 64, seed=3)
    first = gemm.linear(x, used)
    gemm.prepare_weights([used], gated=[used])
    assert not gemm.native_pair(used) and torch.equal(gemm.linear(x, used), first)
    assert torch.equal(gemm.gated_linear(x, used, None, False), gemm.silu_mul(first))


def test_prepare_weights_packs_the_native_panels_into_one_allocation(native) -> None:
    """The engine passes its huge-page allocator: every float32 weight's panels go into
    the one tensor it returns, each on a cache line, a tied weight once, and the linear
    gives the bits it gives from panels packed on their own."""
    ws = [randn(96, 64), randn(40, 64, seed=1), randn(96, 64, seed=2)]
    calls = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        calls.append((shape, dtype))
        return torch.full(shape, float("nan"), dtype=dtype)

    native.prepare_weights([ws[0], ws[1], ws[0], ws[2], randn(8, 64).bfloat16()], allocate)
    if not native._gemm:  # the portable build has no native linear: nothing to place
        assert calls == []
        return
    size = [-(-native._lib.gemm_f32_packed_size(*w.shape) // 16) * 16 for w in ws]
    assert calls == [((sum(size),), torch.float32)]
    packed = [w._pagedserve_native_packed[1] for w in ws]
    offsets = [p.data_ptr() - packed[0].data_ptr() for p in packed]
    assert offsets == [0, 4 * size[0], 4 * (size[0] + size[1])]
    x = randn(3, 64, seed=3)
    for w in ws:
        assert torch.equal(native.linear(x, w), native.linear(x, w.clone()))


def test_packing_can_be_turned_off(monkeypatch) -> None:
    from pagedserve.engine.worker.kernel_settings import kernel_settings
    from pagedserve.kernels import select_kernels

    monkeypatch.setenv("PAGEDSERVE_PACK_WEIGHTS", "0")
    ops = select_kernels("cpu", "cpu", kernel_settings()).ops
    assert isinstance(ops, NativeLayerOps)
    w = randn(8, 4)
    ops.prepare_weights([w])
    assert not hasattr(w, "_pagedserve_packed") and not hasattr(w, "_pagedserve_native_packed")
    x = randn(5, 4, seed=1)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))
