"""Weight-only quantized linears: formats, native kernels at every build level, GGUF loading.
The K-quants' tests take k with as many 256-wide blocks as the others' have 32-wide ones
(``block_k``)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu import quant
from pagedserve.kernels.cpu.layer_ops import (
    QUANT_DIRECT_ROWS,
    QUANT_DIRECT_ROWS_INT8_BY_FORMAT,
    NativeLayerOps,
)
from pagedserve.kernels.layer_ops import TorchLayerOps
from pagedserve.kernels.quant import (
    BLOCK_BYTES,
    BLOCK_FORMATS,
    BLOCK_WEIGHTS,
    FORMATS,
    QuantizedWeight,
    StackedWeight,
    quantize_int8,
)
from tests.helpers.quant import assert_product_close, block_k, random_blocks, random_weight


def test_reference_dequantizes_as_ggml() -> None:
    w = QuantizedWeight.empty("q4_1", 1, 32)
    w.qs.copy_(torch.tensor([[0x21] + [0xF0] * 15], dtype=torch.uint8))
    w.d.fill_(0.5)
    w.m.fill_(-1.0)
    v = w.dequantize()[0]
    # byte 0: low nibble 1 is element 0, high nibble 2 is element 16.
    assert v[0].item() == 0.5 * 1 - 1.0 and v[16].item() == 0.5 * 2 - 1.0
    assert v[1].item() == -1.0 and v[17].item() == 0.5 * 15 - 1.0
    w0 = QuantizedWeight("q4_0", 1, 32, w.qs.clone(), w.d.clone())
    assert w0.dequantize()[0, 0].item() == 0.5 * (1 - 8)
    w8 = QuantizedWeight.empty("q8_0", 1, 32)
    w8.qs.copy_(torch.arange(-16, 16, dtype=torch.int8)[None])
    w8.d.fill_(0.25)
    assert torch.equal(w8.dequantize()[0], torch.arange(-16, 16).float() * 0.25)


def test_int8_quantization_is_per_row_symmetric() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 3.0, -3.0]])
    q = quantize_int8(w)
    assert q.qs.dtype == torch.int8 and q.qs[0].tolist() == [64, -127, 32]
    assert q.d.tolist() == pytest.approx([2 / 127, 1.0, 3 / 127])
    assert (q.dequantize() - w).abs().max().item() <= 3 / 127 / 2 + 1e-7


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.empty("q4_0", 4, 48)
    with pytest.raises(ValueError, match="q4_k needs k a multiple of 256"):
        QuantizedWeight.empty("q4_k", 4, 128)
    with pytest.raises(ValueError, match="quantization format"):
        QuantizedWeight.empty("q3_k", 4, 64)
    a, b = QuantizedWeight.empty("q4_1", 8, 64), QuantizedWeight.empty("q8_0", 2, 64)
    with pytest.raises(ValueError, match="cannot put"):
        a.copy_rows_(0, b)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 64), (70, 96), (33, 320)])
def test_native_kernel_matches_reference(native_lib, fmt, n, k) -> None:
    k = block_k(fmt, k)
    w = random_weight(fmt, n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    for rows in (1, 2, 3, 4, 5, 9, 40):
        x = torch.randn(rows, k, generator=g)
        for b in (None, bias):
            assert_product_close(quant.native_linear(native_lib, x, w, b, 2), x, w, b)
    # Strided rows (a column slice of a wider activation).
    wide = torch.randn(6, k + 16, generator=g)
    assert_product_close(quant.native_linear(native_lib, wide[:, :k], w, None, 2), wide[:, :k], w, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_product_does_not_depend_on_its_batch(native_lib, fmt) -> None:
    """Each row of a batch, and each column however the columns are paired and split
    among threads, is computed exactly as that row alone: a request's logits never
    depend on what shares its step."""
    k = block_k(fmt, 320)
    w = random_weight(fmt, 37, k, seed=5)
    g = torch.Generator().manual_seed(6)
    most = NativeLayerOps(native_lib).quant_max_rows
    x, bias = torch.randn(most, k, generator=g), torch.randn(37, generator=g)
    alone = torch.cat([quant.native_linear(native_lib, x[i:i + 1], w, bias, 1)
                       for i in range(x.shape[0])])  # fmt: skip
    for rows in (2, 5, 8, 13, most):
        for threads in (1, 2, 3):
            got = quant.native_linear(native_lib, x[:rows], w, bias, threads)
            assert torch.equal(got, alone[:rows]), (rows, threads)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_native_kernel_long_rows(native_lib, fmt) -> None:
    """k of 301 blocks: the scales are converted in chunks of 256 blocks."""
    w = random_weight(fmt, 5, 301 * 32, seed=11)
    x = torch.randn(3, 301 * 32, generator=torch.Generator().manual_seed(2))
    assert_product_close(quant.native_linear(native_lib, x, w, None, 2), x, w, None)


@pytest.mark.parametrize("fmt", ["int8"])
@pytest.mark.parametrize("k", [1, 31, 45])
def test_native_int8_takes_any_k(native_lib, fmt, k) -> None:
    w = random_weight(fmt, 5, k)
    x = torch.randn(3, k)
    assert_product_close(quant.native_linear(native_lib, x, w, None, 1), x, w, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_dequantize_is_exact(native_lib, fmt) -> None:
    w = random_weight(fmt, 37, block_k(fmt, 128), seed=3)
    assert torch.equal(quant.native_dequantize(native_lib, w, 2), w.dequantize())
    rows = torch.tensor([5, 0, 36, 5])
    assert torch.equal(quant.native_dequantize(native_lib, w, 2, rows=rows), w.dequantize(rows))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantizing_the_packed_copy_gives_the_planes_bits(native_lib, fmt) -> None:
    """Rows dequantized from the packed copy (column groups, the last one partial; INT8's
    partial last block) are the planes' rows bit for bit; a row past the weight is
    refused by index."""
    k = 45 if fmt == "int8" else block_k(fmt, 96)
    w = random_weight(fmt, 37, k, seed=12)
    packed = quant.native_pack(native_lib, w)
    want = w.dequantize()
    assert torch.equal(quant.native_dequantize(native_lib, w, 2, packed=packed), want)
    rows = torch.tensor([36, 0, 17, 36, 8])
    got = quant.native_dequantize(native_lib, w, 1, rows=rows, packed=packed)
    assert torch.equal(got, want[rows])
    for bad in (37, -1):
        with pytest.raises(IndexError, match="0..36"):
            quant.native_dequantize(native_lib, w, 1, rows=torch.tensor([3, bad]), packed=packed)
    big = random_weight(fmt, 301, block_k(fmt, 1024), seed=13)  # enough work for two threads
    got = quant.native_dequantize(native_lib, big, 2, packed=quant.native_pack(native_lib, big))
    assert torch.equal(got, big.dequantize())


def test_a_stacked_weight_takes_its_slowest_parts_row_limit(native_lib) -> None:
    """A GGUF file's q/k/v of several formats runs in the fused layers up to the least of
    its parts' limits (Q6_K's integer product falls behind sooner on AVX2); op by op each
    part takes its own; the paths line says which formats have a lower limit."""
    ops = NativeLayerOps(native_lib, quantized_activations="int8")
    lower = QUANT_DIRECT_ROWS_INT8_BY_FORMAT.get(ops.isa, {})
    k = block_k("q4_k", 64)
    q4k, q6k = random_weight("q4_k", 16, k, seed=1), random_weight("q6_k", 8, k, seed=2)
    stacked = StackedWeight((q4k, q6k))
    assert ops.quant_rows(q4k) == lower.get("q4_k", ops.quant_max_rows)
    assert ops.quant_rows(stacked) == lower.get("q6_k", ops.quant_max_rows)
    rows = ops.quant_rows(stacked) + 1  # past the Q6_K part's limit, within Q4_K's?
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    out = ops.linear(x, stacked)
    for part, y in ((q4k, out[:, :16]), (q6k, out[:, 16:])):
        assert_product_close(y, x, part, None, int8=rows <= ops.quant_rows(part))
    line = ops.paths()["linear_quant"]
    for fmt, most in lower.items():
        assert f"{fmt} 1-{most}" in line
    float_rows = QUANT_DIRECT_ROWS.get(ops.isa, QUANT_DIRECT_ROWS["portable"])
    assert (f"int8 1-{float_rows}" in line) == (float_rows < ops.quant_max_rows)


@pytest.mark.parametrize("activations", ["float", "int8", "auto"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_ops_route_quantized_weights(native_lib, fmt, activations) -> None:
    """Up to the row limit the native product (8-bit activations for the formats that
    have them, where asked: ``auto`` on the vector builds), above it the dequantized
    weight's float product; embedding lookups dequantize; the paths say which."""
    ops, ref_ops = NativeLayerOps(native_lib, quantized_activations=activations), TorchLayerOps()
    int8 = activations == "int8" or activations == "auto" and ops.isa != "portable"
    assert ops.int8_activations == int8
    direct_int8 = int8 and fmt in quant.INT8_ACTIVATION_FORMATS
    k = block_k(fmt, 64)
    w = random_weight(fmt, 96, k, seed=5)
    bias = torch.randn(96)
    most = ops.quant_rows(w)
    assert most <= ops.quant_max_rows
    if int8 and fmt not in quant.INT8_ACTIVATION_FORMATS:  # float activations: their limit
        assert most == QUANT_DIRECT_ROWS.get(ops.isa, QUANT_DIRECT_ROWS["portable"])
    for rows in (1, most, most + 1, 100):
        x = torch.randn(rows, k)
        assert_product_close(ops.linear(x, w, bias), x, w, bias,
                             int8=direct_int8 and rows <= most)
        assert_product_close(ref_ops.linear(x, w, bias), x, w, bias)
    ids = torch.tensor([3, 95, 3])
    assert torch.equal(ops.embedding(ids, w), w.dequantize(ids))
    assert torch.equal(ref_ops.embedding(ids, w), w.dequantize(ids))
    paths = ops.paths()
    assert paths["linear_quant"].startswith(f"native-{ops.isa}")
    assert paths["quant_activations"] == ("int8" if int8 else "float")
    assert ("int8 activations" in paths["linear_quant"]) == int8


def test_gguf_tensors_equal_the_hf_conversion(default_model_path) -> None:
    """Each tensor of the default model's GGUF, as loaded quantized and dequantized by the
    reference, equals what transformers' GGUF loader made of it (the converted folder),
    Llama's q/k rows back in Hugging Face order."""
    from pagedserve.engine.loader import default_gguf_path, gguf_weights, iter_weights

    path = default_gguf_path()
    formats = gguf_weights.tensor_formats(path)
    assert formats["embed_tokens"] == "q8_0" and formats["layers.0.qkv_proj"] == "q4_1"
    reference = dict(iter_weights(default_model_path))
    seen = set()
    for name, value in gguf_weights.iter_gguf_weights(path, 9, 3, formats):
        if isinstance(value, QuantizedWeight):
            assert value.fmt in ("q4_1", "q8_0")
            value = value.dequantize()
        assert torch.equal(value, reference[name].float()), name
        seen.add(name)
    assert seen == set(reference)


def test_gguf_model_keeps_its_weights_quantized() -> None:
    from pagedserve import LLM

    llm = LLM(quantization="gguf", kv_cache_memory_gb=0.05)
    worker = llm.engine.worker
    model = worker.model
    assert worker.settings.dtype == torch.float32 and worker.quant_desc == "gguf (q4_1, q8_0)"
    qkv = model.layers[0].qkv_proj.weight
    assert isinstance(qkv, QuantizedWeight) and qkv.fmt == "q4_1"
    assert qkv.shape == (9 * 64 + 2 * 3 * 64, 576)
    assert isinstance(model.embed_tokens.weight, QuantizedWeight)
    assert model.embed_tokens.weight.fmt == "q8_0"
    assert not any(p.dim() == 2 for p in model.parameters())  # no float matrix anywhere
    quant_bytes = sum(w.nbytes for w in model.linear_weights())
    # Held once: packed for the native kernels, the planes released (the tied embedding's
    # too: its lookups read the packed copy).
    assert all(w.released and w.qs.numel() == 0 for w in model.linear_weights())
    assert model.embed_tokens.weight.released
    # No larger than the file itself (its float32 expansion is ~540 MB).
    from pagedserve.engine.loader import default_gguf_path

    assert quant_bytes <= default_gguf_path().stat().st_size


def test_quantization_arguments_are_checked(default_model_path) -> None:
    from pagedserve import LLM
    from pagedserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization='fp4'"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ValueError, match="dtype='bfloat16'.*float32"):
        EngineConfig(quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization='gguf'.*model="):
        LLM(model=str(default_model_path), quantization="gguf")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_packed_copy_gives_the_planes_bits(native_lib, fmt) -> None:
    """The engine's path (a copy packed once at load, in groups of output columns) and the
    planes packed for one call are one kernel: the same bits, columns past the last whole
    group included; a changed plane is packed again."""
    k = 45 if fmt == "int8" else block_k(fmt, 96)
    w = random_weight(fmt, 37, k, seed=8)
    assert quant.packed_size(native_lib, w) == native_lib.qgemm_packed_size(
        quant.format_code(w), 37, k) > 0
    packed = quant.cached_pack(native_lib, w)
    assert quant.cached_pack(native_lib, w) is packed
    g = torch.Generator().manual_seed(9)
    x, bias = torch.randn(7, k, generator=g), torch.randn(37, generator=g)
    for rows in (1, 2, 5, 7):
        got = quant.native_linear(native_lib, x[:rows], w, bias, 2, packed)
        assert torch.equal(got, quant.native_linear(native_lib, x[:rows], w, bias, 2))
        assert_product_close(got, x[:rows], w, bias)
    if w.d is None:  # a block format: a byte of codes or scales (not a float16 field)
        w.qs[:, 10].bitwise_xor_(0x55)
    else:  # the planes change: the cached copy is packed again
        w.d.mul_(2)
    again = quant.cached_pack(native_lib, w)
    assert again is not packed
    assert torch.equal(quant.native_linear(native_lib, x, w, None, 1, again),
                       quant.native_linear(native_lib, x, w, None, 1))


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_prepare_weights_packs_quantized_weights_into_one_allocation(native_lib, activations) -> None:
    """The engine's huge-page allocator gets one request for every quantized weight's
    packed copy (for the product the ops chose: float or 8-bit activations), each on a
    cache line and a tied weight once; the linear then reads it, and the planes are
    freed: the products (in registers and dequantized), embedding lookups and the ops'
    fallback give the planes' results, and what reads planes refuses by name."""
    ws = [random_weight("q4_1", 40, 64, seed=1), random_weight("q8_0", 17, 96, seed=2)]
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(3)
    ops = NativeLayerOps(native_lib, quantized_activations=activations)
    assert ops.int8_activations == (activations == "int8")
    codes = [ops.quant_code(w) for w in ws]
    assert [c != quant.format_code(w) for c, w in zip(codes, ws, strict=True)] == [
        activations == "int8"] * 2
    big = ops.quant_max_rows + 1  # dequantized from the copy: float activations
    xs = [torch.randn(5, 64, generator=g), torch.randn(big, 96, generator=g)]
    direct = quant.native_linear(native_lib, xs[0], ws[0], None, threads, code=codes[0])
    floats = [quant.native_linear(native_lib, x, w, None, threads) for x, w in zip(xs, ws, strict=True)]
    ids = torch.tensor([16, 0, 3])
    emb, nbytes = ws[1].dequantize(ids), [w.nbytes for w in ws]
    calls = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        calls.append((shape, dtype))
        return torch.full(shape, 0xAB, dtype=dtype)

    ops.prepare_weights([ws[0], ws[1], ws[0]], allocate)
    sizes = [-(-quant.packed_size(native_lib, w, c) // 64) * 64 for w, c in zip(ws, codes, strict=True)]
    assert calls == [((sum(sizes),), torch.uint8)]
    first, second = (ops.quant_packed(w) for w in ws)
    assert second.data_ptr() - first.data_ptr() == sizes[0]
    assert all(w.released and w.qs.numel() == 0 for w in ws)
    assert [w.nbytes for w in ws] == nbytes
    assert torch.equal(ops.linear(xs[0], ws[0]), direct)
    torch.testing.assert_close(ops.linear(xs[1], ws[1]), floats[1], rtol=1e-5, atol=1e-4)
    assert torch.equal(ops.embedding(ids, ws[1]), emb)
    strided = xs[0].t().contiguous().t()  # not unit-stride rows: the ops' fallback
    torch.testing.assert_close(ops.linear(strided, ws[0]), floats[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="dequantize needs the planes"):
        ws[0].dequantize()
    with pytest.raises(RuntimeError, match="a product, dequantization or packing"):
        quant.native_linear(native_lib, xs[0], ws[0], None, 1)


def test_a_packed_copy_is_made_again_for_another_build_level() -> None:
    """The column groups are as wide as the build's vectors: a weight packed by one build
    level is packed again when another asks (tests run every level in one process)."""
    from pagedserve.kernels.cpu import native as cpu_native

    w = random_weight("q4_1", 40, 64, seed=4)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    for level in (*cpu_native.runnable_levels(), *cpu_native.runnable_levels()[::-1]):
        lib = cpu_native.build_library(level)
        got = quant.native_linear(lib, x, w, None, 1, quant.cached_pack(lib, w))
        assert torch.equal(got, quant.native_linear(lib, x, w, None, 1)), level


def _gguf_dequantize(fmt: str, raw: torch.Tensor) -> torch.Tensor:
    import gguf

    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).copy())


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_formats_dequantize_as_gguf(fmt) -> None:
    """The reference is ``gguf.quants.dequantize`` bit for bit (signed zeros included) on
    random blocks: any bytes are valid codes and sub-block scales, the float16 fields are
    set to finite values. Q5_0/Q5_1 also on blocks gguf-py quantized from floats."""
    for n, blocks, seed in ((1, 1, 0), (5, 3, 1), (16, 2, 2)):
        k = blocks * BLOCK_WEIGHTS[fmt]
        raw = random_blocks(fmt, n, k, seed=seed, scales=(0.5, 0.3))
        assert raw.shape == (n, blocks * BLOCK_BYTES[fmt])
        w = QuantizedWeight(fmt, n, k, raw, None)
        want = _gguf_dequantize(fmt, raw)
        assert torch.equal(w.dequantize().view(torch.int32), want.view(torch.int32))
        rows = torch.tensor([n - 1, 0])
        assert torch.equal(w.dequantize(rows), want[rows])
    if fmt in ("q5_0", "q5_1"):
        import gguf

        floats = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
        raw = torch.from_numpy(gguf.quants.quantize(floats.numpy(),
                                                    gguf.GGMLQuantizationType[fmt.upper()]))
        w = QuantizedWeight(fmt, 6, 128, raw, None)
        assert torch.equal(w.dequantize(), _gguf_dequantize(fmt, raw))
        assert (w.dequantize() - floats).abs().max() < 0.25  # what was quantized


def test_k_quant_sub_block_scales_and_bits() -> None:
    """Where a K-quant weight's bits lie: a Q4_K block whose sub-block 5 has scale 37 and
    min 50 (6-bit values split over bytes 1, 5 and 9 of the scales, GGML's
    ``get_scale_min_k4``), and a Q6_K block's fifth and sixth bits and int8 scale."""
    b = torch.zeros(144, dtype=torch.uint8)
    b[0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # d
    b[2:4] = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)  # dmin
    b[4 + 1] = (37 >> 4) << 6  # sub-block 5's scale: top 2 bits over byte 1
    b[4 + 5] = (50 >> 4) << 6  # its min: top 2 bits over byte 5
    b[4 + 9] = (37 & 15) | (50 & 15) << 4  # low 4 bits of both in byte 9
    b[16 + 64 + 7] = 0xA0  # element 7 of sub-block 5: the high nibble of byte 64 + 7
    w = QuantizedWeight("q4_k", 1, 256, b[None].clone(), None).dequantize()[0]
    assert w[5 * 32 + 7].item() == 37 * 10 - 0.5 * 50
    assert w[5 * 32 + 8].item() == -0.5 * 50 and w[4 * 32 + 7].item() == 0.0
    q6 = torch.zeros(210, dtype=torch.uint8)
    q6[208:210] = torch.tensor([0.25], dtype=torch.float16).view(torch.uint8)
    q6[192 + 8 + 2 * 3 + 1] = 0xFE  # scale -2 for weights 128 + 32 * 3 + 16 .. 31
    q6[64 + 32 + 20] = 0x50  # element 128 + 96 + 20: ql high nibble 5 (t = 3)
    q6[128 + 32 + 20] = 0b10 << 6  # its bits 6-7 of qh: 2, so q = 5 | 2 << 4 = 37
    w6 = QuantizedWeight("q6_k", 1, 256, q6[None].clone(), None).dequantize()[0]
    assert w6[128 + 96 + 20].item() == 0.25 * -2 * (37 - 32)
    assert torch.equal(w6, _gguf_dequantize("q6_k", q6[None])[0])


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_formats_select_and_copy_rows(fmt) -> None:
    """Rows are whole runs of blocks: a selection (Llama's q/k un-permutation) and a
    copy into a fused weight keep each row's blocks."""
    k = BLOCK_WEIGHTS[fmt] * 2
    w = random_weight(fmt, 12, k, seed=7)
    index = torch.tensor([3, 0, 11, 7, 7])
    picked = w.select_rows(index)
    assert (picked.fmt, picked.n, picked.k, picked.d) == (fmt, 5, k, None)
    assert torch.equal(picked.dequantize(), w.dequantize()[index])
    fused = QuantizedWeight.empty(fmt, 17, k)
    assert fused.qs.shape == (17, 2 * BLOCK_BYTES[fmt]) and fused.d is None
    fused.copy_rows_(0, w)
    fused.copy_rows_(12, picked)
    assert torch.equal(fused.dequantize(), torch.cat((w.dequantize(), picked.dequantize())))
    assert fused.nbytes == 17 * 2 * BLOCK_BYTES[fmt]
    assert fused.bits_per_weight == BLOCK_BYTES[fmt] * 8 / BLOCK_WEIGHTS[fmt]


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_format_packed_copy_is_the_files_size(native_lib, fmt) -> None:
    """The packed copy keeps the file's bytes (the K-quants' 6-bit scales and mins
    unpacked to a byte each: within 3%), and once it is made the planes go: products and
    embedding lookups read it."""
    k = BLOCK_WEIGHTS[fmt] * 4
    w = random_weight(fmt, 2 * native_lib_width(native_lib), k, seed=9)
    ops = NativeLayerOps(native_lib)  # float or 8-bit activations: each its own layout
    for code in (quant.format_code(w), quant.format_code(w, int8_activations=True)):
        assert 1.0 <= quant.packed_size(native_lib, w, code) / w.nbytes <= 1.03
    x, ids = torch.randn(3, k), torch.tensor([4, 0, 4])
    before = quant.native_linear(native_lib, x, w, None, 1, code=ops.quant_code(w))
    rows = w.dequantize(ids)
    ops.prepare_weights([w])
    assert w.released and w.qs.numel() == 0 and w.d is None
    assert torch.equal(ops.linear(x, w), before)
    assert torch.equal(ops.embedding(ids, w), rows)


def native_lib_width(lib) -> int:
    """The column groups' width of a build (its vector width; 8 portable)."""
    return {"avx512": 16, "avx2": 8}.get(lib.simd_isa().decode(), 8)


def test_stacked_weight_multiplies_each_part(native_lib) -> None:
    """A fused projection of parts in two formats (a Q4_K_M file's q/k in Q4_K, v in
    Q6_K): filled part by part as a checkpoint's tensors arrive, multiplied part by part
    by the native and the torch layer ops (each part's rows of the bias), the product of
    the stacked reference; packed at load part by part, its planes released."""
    w = StackedWeight.empty([("q4_k", 24), ("q6_k", 8)], 256)
    assert (w.fmt, w.shape, w.nbytes) == ("q4_k+q6_k", (32, 256), 24 * 144 + 8 * 210)
    q, k, v = (random_weight(f, n, 256, seed=n) for f, n in (("q4_k", 16), ("q4_k", 8),
                                                            ("q6_k", 8)))  # fmt: skip
    for offset, part in ((0, q), (16, k), (24, v)):
        w.copy_rows_(offset, part)
    with pytest.raises(ValueError, match="cannot put a q4_k"):
        w.copy_rows_(20, k)  # across two parts
    with pytest.raises(ValueError, match="cannot put a q6_k"):
        w.copy_rows_(8, v)  # into the q4_k part
    want = torch.cat([p.dequantize() for p in (q, k, v)])
    assert torch.equal(w.dequantize(), want)
    x, bias = torch.randn(5, 256), torch.randn(32)
    ops = NativeLayerOps(native_lib)
    assert_product_close(ops.linear(x, w, bias), x, w, bias, int8=ops.int8_activations)
    assert_product_close(TorchLayerOps().linear(x, w, bias), x, w, bias)
    before = ops.linear(x, w, bias)
    ops.prepare_weights([w])
    assert w.released and all(p.released for p in w.parts)
    assert torch.equal(ops.linear(x, w, bias), before)


def test_one_row_limit_for_every_format_when_given(native_lib) -> None:
    """``quant_max_rows`` (the benchmarks' seam) replaces the limits by format and level:
    every kept format takes the native product up to it, the dequantized one above."""
    ops = NativeLayerOps(native_lib, quantized_activations="int8", quant_max_rows=7)
    k = block_k("q6_k", 64)
    for fmt in ("q6_k", "q4_k", "q8_0"):
        w = random_weight(fmt, 16, k, seed=4)
        assert ops.quant_rows(w) == 7
        x = torch.randn(8, k, generator=torch.Generator().manual_seed(5))
        direct = fmt in quant.INT8_ACTIVATION_FORMATS and ops.int8_activations
        assert_product_close(ops.linear(x[:7], w), x[:7], w, None, int8=direct)
        assert_product_close(ops.linear(x, w), x, w, None, int8=False)
    assert "q6_k 1-" not in ops.paths()["linear_quant"]
