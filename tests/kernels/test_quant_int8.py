"""Quantized products with 8-bit activations (``csrc/qgemm_i8.h``) at every build level:
against the reference that quantizes x as GGML's Q8_0 does, row by row independent of
the batch, their own packed layout dequantized bit for bit, refusals by format."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import quant
from pagedserve.kernels.quant import FORMATS
from tests.helpers.quant import assert_product_close, block_k, int8_activations, random_weight

INT8 = quant.INT8_ACTIVATION_FORMATS


def _code(w) -> int:
    return quant.format_code(w, int8_activations=True)


@pytest.mark.parametrize("fmt", INT8)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 64), (70, 96), (33, 320), (130, 1536)])
def test_int8_product_matches_the_quantized_activation_reference(native_lib, fmt, n, k) -> None:
    k = block_k(fmt, k)
    w = random_weight(fmt, n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    packed = quant.native_pack(native_lib, w, code=_code(w))
    for rows in (1, 2, 3, 4, 5, 9, 40):
        x = torch.randn(rows, k, generator=g) * 3
        for b in (None, bias):
            got = quant.native_linear(native_lib, x, w, b, 2, packed, _code(w))
            assert_product_close(got, x, w, b, int8=True)
            # From the planes (packed for the call): the same values.
            assert torch.equal(quant.native_linear(native_lib, x, w, b, 2, code=_code(w)), got)
    wide = torch.randn(6, k + 16, generator=g)  # strided rows
    got = quant.native_linear(native_lib, wide[:, :k], w, None, 2, packed, _code(w))
    assert_product_close(got, wide[:, :k], w, None, int8=True)


@pytest.mark.parametrize("fmt", INT8)
def test_int8_error_against_float_activations_is_the_quantization_step(native_lib, fmt) -> None:
    """The 8-bit product differs from the float one by what rounding x to 8 bits a block
    costs (about 0.2% of the products' scale here), not more: the scales are applied."""
    k = 1536 if fmt in ("q4_k", "q5_k", "q6_k") else 1024
    w = random_weight(fmt, 256, k, seed=3)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(4))
    got = quant.native_linear(native_lib, x, w, None, 2, code=_code(w)).double()
    ref = F.linear(x.double(), w.dequantize().double())
    scale = F.linear(x.abs().double(), w.dequantize().abs().double())
    err = ((got - ref).abs() / scale).max().item()
    assert 1e-5 < err < 1e-2, err
    assert ((int8_activations(x) - x.double()).abs().max() > 0).item()


@pytest.mark.parametrize("fmt", INT8)
def test_int8_rows_do_not_depend_on_their_batch(native_lib, fmt) -> None:
    k = block_k(fmt, 128)
    w = random_weight(fmt, 45, k, seed=7)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(8))
    packed = quant.native_pack(native_lib, w, code=_code(w))
    whole = quant.native_linear(native_lib, x, w, None, 2, packed, _code(w))
    for i in range(x.shape[0]):
        one = quant.native_linear(native_lib, x[i:i + 1], w, None, 1, packed, _code(w))
        assert torch.equal(one[0], whole[i]), i


@pytest.mark.parametrize("fmt", INT8)
def test_int8_packed_copy_dequantizes_to_the_planes_bits(native_lib, fmt) -> None:
    w = random_weight(fmt, 37, block_k(fmt, 96), seed=9)
    packed = quant.native_pack(native_lib, w, code=_code(w))
    # The file's bytes a column (Q4_K/Q5_K: 4 more a block, their unpacked scales).
    extra = 4 * w.k // 256 if fmt in ("q4_k", "q5_k") else 0
    assert packed.numel() == -(-37 // 8) * 8 * (w.nbytes // 37 + extra)
    whole = quant.native_dequantize(native_lib, w, 2, packed=packed, code=_code(w))
    assert torch.equal(whole, w.dequantize())
    rows = torch.tensor([36, 0, 8, 8])
    got = quant.native_dequantize(native_lib, w, 1, rows=rows, packed=packed, code=_code(w))
    assert torch.equal(got, w.dequantize(rows))
    # From the planes the flag is only the format's product: the planes' values.
    assert torch.equal(quant.native_dequantize(native_lib, w, 1, code=_code(w)), w.dequantize())


def test_int8_blocks_of_zeros_and_of_huge_values(native_lib) -> None:
    """A block of zeros quantizes to zeros (its scale 0, no division by it): the bias
    alone; a block with an infinity gives a non-finite sum, never a crash."""
    w = random_weight("q8_0", 16, 64, seed=10)
    bias = torch.randn(16)
    zeros = torch.zeros(2, 64)
    got = quant.native_linear(native_lib, zeros, w, bias, 1, code=_code(w))
    assert torch.equal(got, bias.expand(2, 16))
    half = torch.randn(1, 64)
    half[0, :32] = 0.0
    got = quant.native_linear(native_lib, half, w, None, 1, code=_code(w))
    assert_product_close(got, half, w, None, int8=True)
    inf = torch.randn(1, 64)
    inf[0, 3] = float("inf")
    assert not torch.isfinite(quant.native_linear(native_lib, inf, w, None, 1, code=_code(w))).all()


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f not in INT8])
def test_formats_without_an_int8_product_keep_float_activations(native_lib, fmt) -> None:
    w = random_weight(fmt, 8, block_k(fmt, 64), seed=11)
    assert quant.format_code(w, int8_activations=True) == quant.format_code(w)
    flagged = quant.format_code(w) | quant.I8A
    assert native_lib.qgemm_packed_size(flagged, 8, w.k) == -1
    with pytest.raises(ValueError, match=f"qgemm_pack refused a {fmt}"):
        quant.packed_size(native_lib, w, flagged)


def _dots_expected(lib) -> tuple[str, ...]:
    """The integer dots a library should offer, from the CPU's flags as Linux reports
    them (asked of the host, not of the code under test)."""
    from pagedserve.kernels.cpu import native as cpu_native

    isa = cpu_native.isa(lib)
    if isa == "portable":
        return ()
    flag = {"avx2": "avx_vnni", "avx512": "avx512_vnni"}[isa]
    built = cpu_native.int8_dots_built(lib)
    assert built[0] == "maddubs" and ("vnni512" in built) <= (isa == "avx512" and "vnni" in built)
    if flag not in cpu_native.cpu_features():
        return ("maddubs",)
    return built


def test_int8_dots_follow_the_build_and_the_cpu(native_lib, monkeypatch) -> None:
    """VNNI's dots where the level's encoding is built and the CPU reports it (at 512
    bits too on AVX-512 builds), maddubs on every vector build; ``auto`` takes the widest
    VNNI there is; a kind that is not there is a ValueError naming what is, and leaves
    the kind in use as it was."""
    from pagedserve.kernels.cpu import native as cpu_native
    from pagedserve.kernels.cpu.layer_ops import NativeLayerOps

    have = _dots_expected(native_lib)
    assert cpu_native.int8_dots_available(native_lib) == have
    ops = NativeLayerOps(native_lib)
    want = have[-1] if have else None
    assert ops.int8_dots == cpu_native.int8_dots(native_lib) == want
    if want:
        assert f"int8 activations, {want} dots" in ops.paths()["linear_quant"]
    else:
        assert " dots" not in ops.paths()["linear_quant"]
    for dots in ("vnni512", "vnni", "maddubs"):
        if dots not in have:
            with pytest.raises(ValueError, match=f"int8 dots '{dots}' are not available on this "
                                                 f"{ops.isa} build"):
                NativeLayerOps(native_lib, int8_dots=dots)
            assert cpu_native.int8_dots(native_lib) == want
    with pytest.raises(ValueError, match="int8 dots 'sdot': expected auto, maddubs, vnni, vnni512"):
        cpu_native.use_int8_dots(native_lib, "sdot")
    # A CPU without the flag is offered maddubs only, even from a build that has VNNI.
    flags = cpu_native.cpu_features() - {"avx_vnni", "avx512_vnni"}
    monkeypatch.setattr(cpu_native, "cpu_features", lambda: flags)
    assert cpu_native.int8_dots_available(native_lib) == have[:1]
    assert NativeLayerOps(native_lib).int8_dots == (have[0] if have else None)
    cpu_native.use_int8_dots(native_lib, "auto")


@pytest.mark.parametrize("fmt", INT8)
def test_every_kind_of_int8_dot_gives_the_same_bits(native_lib, fmt) -> None:
    """Each kind of integer dot this build and CPU have (maddubs, VNNI at 256 and 512
    bits) matches the reference, and they equal each other bit for bit: the same integer
    sums, then the same float steps (row tiles of 1-8, column groups with padding, an odd
    group count and an even one included)."""
    from pagedserve.kernels.cpu import native as cpu_native

    have = cpu_native.int8_dots_available(native_lib)
    assert have == _dots_expected(native_lib)
    k = block_k(fmt, 320)
    g = torch.Generator().manual_seed(22)
    for n in (45, 61, 3):  # 6 groups (the last padded), 8 (padded), 1
        w = random_weight(fmt, n, k, seed=21 + n)
        bias = torch.randn(n, generator=g)
        packed = quant.native_pack(native_lib, w, code=_code(w))
        xs = [torch.randn(rows, k, generator=g) * 3 for rows in (1, 2, 3, 4, 5, 9, 40)]
        outs = {}
        try:
            for dots in have or (None,):
                if dots:
                    assert cpu_native.use_int8_dots(native_lib, dots) == dots
                outs[dots] = [quant.native_linear(native_lib, x, w, bias, 2, packed, _code(w))
                              for x in xs]  # fmt: skip
                for x, got in zip(xs, outs[dots], strict=True):
                    assert_product_close(got, x, w, bias, int8=True)
        finally:
            cpu_native.use_int8_dots(native_lib, "auto")
        first = next(iter(outs.values()))
        for dots, got in outs.items():
            assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True)), (n, dots)
