"""Every decoder layer in one native call (``pagedserve.kernels.cpu.decoder``) against the per-op
loop: the same logits and the same KV cache, bit for bit, at every build level (with
experts: to float32 rounding, their softmax being libm's, not torch's)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec, QuantLinear
from pagedserve.kernels.cpu.backend import CpuBackend
from pagedserve.kernels.cpu.layer_ops import FUSED_MAX_ROWS, NativeLayerOps
from pagedserve.kernels.interface import AttentionMetadata
from pagedserve.kernels.quant import StackedWeight
from pagedserve.kernels.torch_ref import quantize_kv_rows
from tests.helpers.quant import random_weight

BLOCK = 16


def _config(arch: str, hidden: int = 64, inter: int = 128):
    import transformers

    common = dict(vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=arch == "qwen3")  # fmt: skip
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "mistral_window":  # every layer slides over its last 9 positions
        return transformers.MistralConfig(**common, sliding_window=9)
    if arch == "qwen2_window":  # layers 1 and 2 slide over 6 positions, layer 0 does not
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=6,
                                        max_window_layers=1)
    if arch == "qwen2_moe":  # layers 0 and 2: 6 experts (2 a token) and a shared one
        return transformers.Qwen2MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, mlp_only_layers=[1])  # fmt: skip
    if arch == "qwen3_moe":  # 8 experts, 3 a token, renormalized
        return transformers.Qwen3MoeConfig(head_dim=16, num_experts=8, num_experts_per_tok=3,
                                           moe_intermediate_size=32, norm_topk_prob=True,
                                           **common)  # fmt: skip
    if arch == "gemma2":  # soft-capped scores, layer 0 slides over 6 positions
        return transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24,
                                         sliding_window=6, attn_logit_softcapping=8.0,
                                         final_logit_softcapping=6.0)  # fmt: skip
    if arch == "gemma3":  # q/k norms; two sliding layers (local RoPE) to one full
        return transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=32, sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0,
                                   "rope_theta": 1000000.0}})  # fmt: skip
    return transformers.Qwen3Config(head_dim=16, **common)


def _model(arch: str, quant: str | None, hidden: int = 64, inter: int = 128) -> DecoderForCausalLM:
    cfg = _config(arch, hidden, inter)
    model = DecoderForCausalLM(DecoderSpec.from_hf(cfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.15 if p.dim() > 1 else 0.05) + (
                0 if p.dim() > 1 else 1))
    if quant == "int8":
        model.quantize_int8()
    elif quant == "stacked":  # q/k/v and gate/up of two formats each, as Q4_K_M files have
        for i, layer in enumerate(model.layers):
            qk = layer.q_size + layer.kv_size
            layer.qkv_proj = QuantLinear(StackedWeight((
                random_weight("q4_k", qk, hidden, seed=10 * i),
                random_weight("q6_k", layer.kv_size, hidden, seed=10 * i + 1))),
                layer.qkv_proj.bias)  # fmt: skip
            layer.gate_up_proj = QuantLinear(StackedWeight((
                random_weight("q5_k", inter, hidden, seed=10 * i + 2),
                random_weight("q5_0", inter, hidden, seed=10 * i + 3))), None)  # fmt: skip
            layer.o_proj = QuantLinear(random_weight("q4_k", hidden, layer.q_size, seed=10 * i + 4),
                                       layer.o_proj.bias)  # fmt: skip
            layer.down_proj = QuantLinear(random_weight("q6_k", hidden, inter, seed=10 * i + 5),
                                          None)  # fmt: skip
        model._stack = None
    elif quant is not None:  # every projection, an expert's too (not the routers)
        for i, layer in enumerate(model.layers):
            for j, (name, old) in enumerate(list(layer.linears())):
                w = random_weight(quant, old.out_features, old.in_features, seed=100 * i + j)
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, attr,
                        QuantLinear(w, old.bias))
        model._stack = None
    model.set_rope(cfg, 512)
    return model.eval()


def _step(q_lens: list[int], ctx: list[int]):
    """A step: request i has ``ctx[i]`` tokens cached and ``q_lens[i]`` new ones (decodes
    first), each request in its own run of blocks."""
    blocks = [(c + q + BLOCK - 1) // BLOCK for c, q in zip(ctx, q_lens, strict=True)]
    width = max(blocks)
    table = torch.zeros(len(q_lens), width, dtype=torch.int32)
    slots, positions, qsl, lens, first = [], [], [0], [], 1
    for i, (c, q) in enumerate(zip(ctx, q_lens, strict=True)):
        ids = list(range(first, first + blocks[i]))[::-1]  # scattered, not in order
        first += blocks[i]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for p in range(c, c + q):
            slots.append(ids[p // BLOCK] * BLOCK + p % BLOCK)
            positions.append(p)
        qsl.append(qsl[-1] + q)
        lens.append(c + q)
    meta = AttentionMetadata.from_host(torch.tensor(slots), qsl, lens, table,
                                       sum(1 for q in q_lens if q == 1), "cpu")  # fmt: skip
    return torch.tensor(positions), meta, first


def _run(model, backend, positions, meta, kv):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.spec.vocab_size, positions.shape, generator=g)
    for m in meta.groups:
        backend.prepare(m, BLOCK)
    with torch.inference_mode():
        hidden = model(ids, positions, kv, meta, backend)
        return model.compute_logits(hidden, backend.ops)


def _caches(model, num_blocks: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(2)
    s = model.spec
    shape = (num_blocks, BLOCK, s.num_kv_heads, s.head_dim)

    def cache():
        values = torch.randn(shape, generator=g)
        return quantize_kv_rows(values) if dtype == torch.int8 else values.to(dtype)

    return [(cache(), cache()) for _ in range(s.num_layers)]


def _compare(native_lib, model, q_lens, ctx, expect_fused: bool,
             kv_dtype: torch.dtype = torch.float32, exact: bool = True, pairs: bool = True):
    positions, meta, num_blocks = _step(q_lens, ctx)
    ops = NativeLayerOps(native_lib)
    if pairs:  # as the engine loads: the MLPs' float32 gate/up weights packed in pairs
        ops.prepare_weights(model.linear_weights(), gated=model.gated_weights())
        for weight in model.gated_weights():
            assert ops.native_pair(weight) == (native_lib.gemm_f32_available() == 1
                                               and isinstance(weight, torch.Tensor)
                                               and weight.dtype == torch.float32)
    fused, loop = CpuBackend(native_lib, ops), CpuBackend(native_lib, ops, fuse_layers=False)
    kv_fused = _caches(model, num_blocks, kv_dtype)
    kv_loop = [(k.clone(), v.clone()) for k, v in kv_fused]
    for m in meta.groups:
        fused.prepare(m, BLOCK)
    with torch.inference_mode():
        hidden = torch.randn(positions.shape[0], model.spec.hidden_size,
                             generator=torch.Generator().manual_seed(3))
        took = fused.run_layers(model.decoder_stack(), hidden, positions, kv_fused, meta)
    assert (took is not None) == expect_fused
    kv_fused = _caches(model, num_blocks, kv_dtype)  # undo that probe's cache writes
    got = _run(model, fused, positions, meta, kv_fused)
    want = _run(model, loop, positions, meta, kv_loop)
    same = torch.equal if exact else \
        lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5)  # fmt: skip
    assert same(got, want), (got - want).abs().max()
    for (kf, vf), (kl, vl) in zip(kv_fused, kv_loop, strict=True):
        assert same(kf, kl) and same(vf, vl)


STEPS = [([1], [0]), ([1], [37]), ([1, 1, 1], [5, 70, 16]), ([1, 1, 9, 3], [20, 33, 0, 40]),
         ([17], [0])]  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral_window", "qwen2_window"])
@pytest.mark.parametrize("q_lens,ctx", STEPS)
def test_float32_fused_equals_loop(native_lib, arch, q_lens, ctx):
    # The portable build has no native float32 linear: nothing to fuse there.
    model = _model(arch, None)
    if arch.endswith("_window"):  # each layer's window reaches the native call
        windows = [x.window for x in model.decoder_stack().layers]
        assert windows == ([9] * 3 if arch == "mistral_window" else [0, 6, 6])
    _compare(native_lib, model, q_lens, ctx, bool(native_lib.gemm_f32_available()))


@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [5, 70, 16]), ([1, 1, 9, 3], [20, 33, 0, 40])])
def test_float32_fused_equals_loop_with_plain_gate_up_panels(native_lib, q_lens, ctx):
    """Weights packed at their first use, the gate/up weight by a plain linear (no pairs):
    the fused call then takes the product and the gate apart."""
    model = _model("llama", None)
    _compare(native_lib, model, q_lens, ctx, bool(native_lib.gemm_f32_available()), pairs=False)
    ops = NativeLayerOps(native_lib)
    assert not any(ops.native_pair(w) for w in model.gated_weights())


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("quant", [None, "q4_1"])
@pytest.mark.parametrize("q_lens,ctx", STEPS)
def test_gemma_fused_equals_loop(native_lib, arch, quant, q_lens, ctx):
    # Gemma's output norms, GELU-tanh, query scale and soft cap (2); q/k norms and each
    # layer's own RoPE tables (3), in the one call as in the loop.
    model = _model(arch, quant)
    stack = model.decoder_stack()
    assert stack.activation == "gelu_tanh" and stack.scale == model.spec.scale != 16 ** -0.5
    assert all(x.attn_out_norm is not None and x.mlp_out_norm is not None for x in stack.layers)
    if arch == "gemma3":
        local, full = stack.layers[0].rope_cos, stack.layers[2].rope_cos
        assert stack.layers[1].rope_cos is local and not torch.equal(local, full)
    else:
        assert stack.softcap == 8.0 and [x.window for x in stack.layers] == [6, 0, 6]
    _compare(native_lib, model, q_lens, ctx, quant is not None or
             bool(native_lib.gemm_f32_available()))  # fmt: skip


def _second_group(meta: AttentionMetadata, num_blocks: int) -> AttentionMetadata:
    """Another KV group's metadata for the step of ``meta``: the same requests, their
    blocks ``num_blocks`` further on."""
    table = torch.where(meta.block_tables > 0, meta.block_tables + num_blocks, 0)
    slots = meta.slot_mapping + num_blocks * BLOCK
    return AttentionMetadata.from_host(slots, meta.query_start_loc_cpu, meta.seq_lens_cpu,
                                       table, meta.num_decodes, "cpu")  # fmt: skip


@pytest.mark.parametrize("quant", [None, "q4_1"])
@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [5, 70, 16]), ([1, 1, 9, 3], [20, 33, 0, 40])])
def test_kv_groups_fused_equal_loop(native_lib, quant, q_lens, ctx):
    # A hybrid cache: the sliding layers read and write their own group's blocks.
    model = _model("gemma3", quant)
    model.kv_layer_groups = (1, 1, 0)
    assert [x.kv_group for x in model.decoder_stack().layers] == [1, 1, 0]
    positions, meta, num_blocks = _step(q_lens, ctx)
    meta.other_groups = (_second_group(meta, num_blocks),)
    ops = NativeLayerOps(native_lib)
    runs = []
    for backend in (CpuBackend(native_lib, ops), CpuBackend(native_lib, ops, fuse_layers=False)):
        kv = _caches(model, 2 * num_blocks)
        runs.append((_run(model, backend, positions, meta, kv), kv))
    (got, kv_fused), (want, kv_loop) = runs
    assert torch.equal(got, want)
    for (kf, vf), (kl, vl) in zip(kv_fused, kv_loop, strict=True):
        assert torch.equal(kf, kl) and torch.equal(vf, vl)
    fresh = _caches(model, 2 * num_blocks)  # each layer wrote its own group's blocks only
    one, zero = slice(num_blocks, None), slice(0, num_blocks)
    for i, (k, _) in enumerate(kv_fused):
        mine, theirs = (one, zero) if i < 2 else (zero, one)
        assert torch.equal(k[theirs], fresh[i][0][theirs])
        assert not torch.equal(k[mine], fresh[i][0][mine])
    backend = CpuBackend(native_lib, ops)
    for m in meta.groups:
        backend.prepare(m, BLOCK)
    hidden = torch.randn(positions.shape[0], model.spec.hidden_size)
    with torch.inference_mode():
        took = backend.run_layers(model.decoder_stack(), hidden, positions, kv_fused, meta)
    assert (took is not None) == (quant is not None or bool(native_lib.gemm_f32_available()))
    meta.other_groups = ()  # a stack that reads group 1 is not run with one group
    backend.prepare(meta, BLOCK)
    with torch.inference_mode():
        assert backend.run_layers(model.decoder_stack(), hidden, positions, kv_fused,
                                  meta) is None


@pytest.mark.parametrize("quant", ["q4_1", "q4_0", "q8_0", "int8", "q5_0", "q5_1"])
@pytest.mark.parametrize("q_lens,ctx", STEPS)
def test_quantized_fused_equals_loop(native_lib, quant, q_lens, ctx):
    _compare(native_lib, _model("llama", quant), q_lens, ctx, True)


@pytest.mark.parametrize("quant", ["q4_k", "q5_k", "q6_k", "stacked"])
@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [5, 70, 16]), ([1, 1, 9, 3], [20, 33, 0, 40])])
def test_k_quant_fused_equals_loop(native_lib, quant, q_lens, ctx):
    # K-quant blocks are 256 wide: a model whose projections take 256 inputs. "stacked":
    # fused projections whose parts differ in format, in the one call too.
    _compare(native_lib, _model("llama", quant, hidden=256, inter=256), q_lens, ctx, True)


@pytest.mark.parametrize("quant", ["q4_0", "q4_1"])
@pytest.mark.parametrize("q_lens,ctx", [([1], [37]), ([1, 1, 9, 3], [20, 33, 0, 40])])
def test_reordered_inputs_fused_equal_loop(native_lib, quant, q_lens, ctx):
    # Act-order checkpoints: projections whose weight columns are stored in another
    # order take their input gathered in that order, in the fused call as in the loop.
    model = _model("llama", quant)
    g = torch.Generator().manual_seed(4)
    model.set_input_orders({
        f"layers.{i}.{name}": torch.randperm(getattr(layer, name).in_features, generator=g)
        for i, layer in enumerate(model.layers) for name in ("qkv_proj", "o_proj", "down_proj")})
    assert model.decoder_stack().layers[0].orders[2] is None  # gate_up keeps its order
    _compare(native_lib, model, q_lens, ctx, True)
    # ... and the orders matter: another order for one projection gives other logits.
    positions, meta, num_blocks = _step(q_lens, ctx)
    backend = CpuBackend(native_lib, NativeLayerOps(native_lib))
    with_orders = _run(model, backend, positions, meta, _caches(model, num_blocks))
    model.set_input_orders({f"layers.{i}.o_proj": torch.arange(64) for i in range(3)})
    assert not torch.equal(_run(model, backend, positions, meta, _caches(model, num_blocks)),
                           with_orders)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("quant", [None, "q4_1"])
@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [5, 70, 16]), ([1, 1, 9, 3], [20, 33, 0, 40])])
def test_narrow_cache_fused_equals_loop(native_lib, kv_dtype, quant, q_lens, ctx):
    # kv_cache_dtype under a float32 model: the fused call rounds (or quantizes) its
    # float32 K/V into the cache as the per-op loop's kernel call does.
    _compare(native_lib, _model("llama", quant), q_lens, ctx,
             quant is not None or bool(native_lib.gemm_f32_available()), kv_dtype)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("quant", [None, "int8", "q4_1"])
@pytest.mark.parametrize("q_lens,ctx", STEPS)
def test_experts_fused_equal_loop(native_lib, arch, quant, q_lens, ctx):
    # The routers stay float32: no fused call without the native float32 linear.
    model = _model(arch, quant)
    assert model.layers[0].moe is not None
    _compare(native_lib, model, q_lens, ctx, bool(native_lib.gemm_f32_available()),
             exact=False)  # fmt: skip


def test_experts_with_reordered_inputs_fused_equal_loop(native_lib):
    model = _model("qwen2_moe", "int8")
    g = torch.Generator().manual_seed(5)
    model.set_input_orders({
        f"layers.{i}.{name}": torch.randperm(proj.in_features, generator=g)
        for i in (0, 2) for name, proj in model.layers[i].linears() if name.startswith("moe.")})
    ex = model.decoder_stack().layers[0].experts
    assert all(o is not None for pair in (*ex.orders, ex.shared_orders) for o in pair)
    _compare(native_lib, model, [1, 1, 9, 3], [20, 33, 0, 40],
             bool(native_lib.gemm_f32_available()), exact=False)  # fmt: skip


def test_a_row_of_nan_stays_in_its_row(native_lib):
    # NaN router logits (a request whose activations overflowed) route somewhere and give
    # that row NaN; the other requests' rows are what they are without it.
    model = _model("qwen2_moe", None)
    positions, meta, num_blocks = _step([1, 1, 1], [5, 70, 16])
    backend = CpuBackend(native_lib, NativeLayerOps(native_lib))
    backend.prepare(meta, BLOCK)
    hidden = torch.randn(3, model.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    outs = []
    for bad in (False, True):
        h = hidden.clone()
        if bad:
            h[1] = float("nan")
        with torch.inference_mode():
            took = backend.run_layers(model.decoder_stack(), h, positions,
                                      _caches(model, num_blocks), meta)  # fmt: skip
        if not native_lib.gemm_f32_available():  # this build has no fused call for it
            assert took is None
            return
        outs.append(took[0])
    assert torch.isnan(outs[1][1]).all()
    assert torch.equal(outs[1][[0, 2]], outs[0][[0, 2]])


def test_steps_past_the_fused_rows_take_the_loop(native_lib):
    # A quantized model fuses steps of up to the quantized kernel's row limit, and never
    # more than the float32 limit (the fused call's scratch grows with its rows).
    rows = min(NativeLayerOps(native_lib).quant_max_rows, FUSED_MAX_ROWS) + 1
    _compare(native_lib, _model("llama", "q4_1"), [1, rows - 1], [10, 0], False)
    _compare(native_lib, _model("llama", "q4_1"), [1, rows - 2], [10, 0], True)


def test_switched_off_backend_takes_the_loop(native_lib):
    ops = NativeLayerOps(native_lib)
    assert CpuBackend(native_lib, ops).fuses_layers
    assert not CpuBackend(native_lib, ops, fuse_layers=False).fuses_layers
