"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy output equals HF
transformers, int8 experts, GPTQ and AWQ checkpoints, tensor parallel, and what such a
model refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.engine.models.decoder import QuantLinear
from pagedserve.engine.models.spec import DecoderSpec
from pagedserve.engine.worker.settings import check_moe
from pagedserve.kernels.quant import quantize_int8
from tests.helpers.hf import hf_greedy
from tests.helpers.quantized_checkpoints import Scheme, write_quantized

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
WORDS = "the quick brown fox jumps over the lazy dog and keeps running far away".split()


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(" ".join(WORDS[: 3 + 5 * i]) * (1 + i)) for i in range(6)]


def greedy(llm: LLM, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n),
                        use_tqdm=False)  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_layers_hold_the_configured_experts(arch, tiny_model_factory):
    llm = LLM(str(tiny_model_factory(arch)), dtype="float32", kv_cache_memory_gb=0.02)
    layers = llm.engine.worker.model.layers
    cfg = json.loads((tiny_model_factory(arch) / "config.json").read_text())
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    sparse = [0] if arch == "qwen2_moe" else [0, 1]  # qwen2_moe: mlp_only_layers=[1]
    for i, layer in enumerate(layers):
        if i not in sparse:
            assert layer.moe is None and layer.gate_up_proj is not None
            continue
        assert layer.moe is not None and layer.gate_up_proj is None and layer.down_proj is None
        assert len(layer.moe.experts) == experts
        assert (layer.moe.shared_expert is not None) == (arch == "qwen2_moe")
        assert layer.moe.spec.norm_topk_prob == (arch != "qwen2_moe")


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_steps_run_in_the_all_layer_native_call(arch, tiny_model_factory, prompts):
    # Where this CPU build has the native float32 linear, every step of this model runs
    # its layers, experts included, in one native call: ops.linear only makes the logits.
    llm = LLM(str(tiny_model_factory(arch)), dtype="float32", kv_cache_memory_gb=0.02)
    worker = llm.engine.worker
    paths = worker.cpu_paths or {}
    fused = paths.get("layers") == "fused" and paths.get("linear_f32", "").startswith("native")
    calls = []
    linear = worker.attn.ops.linear
    worker.attn.ops.linear = lambda x, w, b=None: calls.append(w.shape) or linear(x, w, b)
    try:
        greedy(llm, prompts[:1], 4)
    finally:
        del worker.attn.ops.linear
    head = tuple(worker.model.embed_tokens.weight.shape if worker.model.lm_head is None
                 else worker.model.lm_head.weight.shape)  # fmt: skip
    if fused:
        assert calls and all(tuple(c) == head for c in calls), calls[:4]
    else:
        assert any(tuple(c) != head for c in calls)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_models_match_hf(arch, backend, tiny_model_factory, prompts):
    path = tiny_model_factory(arch)
    ref = hf_greedy(path, prompts, 24)
    for kwargs in ({"max_num_batched_tokens": 16},  # chunked prefill mixed with decodes
                   {"num_gpu_blocks_override": 12, "max_num_batched_tokens": 32},  # preempts
                   {"enable_chunked_prefill": False, "max_num_seqs": 1}):
        llm = LLM(str(path), dtype="float32", enable_prefix_caching=False,
                  attention_backend=backend, **kwargs)  # fmt: skip
        assert greedy(llm, prompts) == ref, kwargs
        assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


def test_routing_uses_every_expert_and_weights_sum_to_one(tiny_model_factory, prompts):
    llm = LLM(str(tiny_model_factory("qwen3_moe")), dtype="float32", kv_cache_memory_gb=0.02)
    moe = llm.engine.worker.model.layers[0].moe
    ops = llm.engine.worker.attn.ops
    x = torch.randn(64, moe.gate.in_features, generator=torch.Generator().manual_seed(0))
    experts, weights = moe.route(x, ops)
    assert experts.shape == weights.shape == (64, 3)
    assert set(experts.flatten().tolist()) == set(range(8))
    assert all(len(set(row)) == 3 for row in experts.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))
    # Against the experts run one token at a time, densely.
    out = moe(x, ops)
    for t in (0, 17, 63):
        want = sum(w * moe.experts[e](x[t:t + 1], ops)[0]
                   for e, w in zip(experts[t].tolist(), weights[t], strict=True))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


def _int8_reference(src: Path, out: Path) -> Path:
    """``src`` with every weight the engine's int8 keeps quantized (projections, experts,
    lm_head; not routers, embeddings, norms) replaced by its int8 dequantization."""
    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    for name, w in tensors.items():
        if w.dim() == 2 and "embed_tokens" not in name and not name.endswith(
                (".gate.weight", "shared_expert_gate.weight")):  # fmt: skip
            tensors[name] = quantize_int8(w.float()).dequantize().to(w.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_int8_experts_equal_hf_on_the_dequantized_weights(arch, tiny_model_factory, prompts,
                                                          tmp_path):  # fmt: skip
    path = tiny_model_factory(arch)
    llm = LLM(str(path), quantization="int8", kv_cache_memory_gb=0.02)
    layer = llm.engine.worker.model.layers[0]
    assert all(isinstance(m, QuantLinear) and m.weight.fmt == "int8"
               for _, m in layer.linears())  # fmt: skip
    assert sum(1 for _ in layer.linears()) == 2 + 2 * len(layer.moe.experts) + \
        2 * (layer.moe.shared_expert is not None)  # fmt: skip
    assert layer.moe.gate.weight.dtype == torch.float32  # the router stays float
    ref = hf_greedy(_int8_reference(path, tmp_path / "int8"), prompts, 24)
    assert greedy(llm, prompts) == ref


QUANTIZED = {
    # name: (architecture, scheme, the native format of every projection)
    "gptq4-act-order-qwen2_moe": ("qwen2_moe", Scheme(group_size=32, desc_act=True), "q4_0"),
    "gptq4-zero-biases-mixtral": ("mixtral", Scheme(group_size=32, extra_bias=True), "q4_0"),
    "awq-qwen3_moe": ("qwen3_moe", Scheme(method="awq", group_size=32, sym=False), "q4_1"),
}


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_gptq_and_awq_experts_stay_quantized_and_equal_hf(name, tiny_model_factory, prompts,
                                                           tmp_path):  # fmt: skip
    arch, scheme, fmt = QUANTIZED[name]
    quantized, ref = tmp_path / "q", tmp_path / "ref"
    write_quantized(tiny_model_factory(arch), quantized, ref, scheme)
    if scheme.extra_bias:  # GPTQ's all-zero biases, the routers' too, are dropped
        tensors = load_file(quantized / "model.safetensors")
        tensors["model.layers.1.block_sparse_moe.gate.bias"] = torch.zeros(4).half()
        save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    expected = hf_greedy(ref, prompts, 24)
    for backend in ("auto", "torch"):
        llm = LLM(str(quantized), attention_backend=backend, kv_cache_memory_gb=0.02,
                  quantized_activations="float")
        model = llm.engine.worker.model
        for layer in model.layers:
            projections = dict(layer.linears())
            assert all(isinstance(m, QuantLinear) and m.weight.fmt == fmt
                       for m in projections.values()), name  # fmt: skip
            # act-order: the inputs of every projection with more than one group gathered
            ordered = {n for n, m in projections.items() if m.input_order is not None}
            assert ordered == ({n for n, m in projections.items()
                                if m.in_features > scheme.group_size}
                               if scheme.desc_act else set())  # fmt: skip
            if layer.moe is not None:  # the routers are float, as the checkpoint has them
                assert isinstance(layer.moe.gate.weight, torch.Tensor)
                assert len(projections) == 2 + 2 * len(layer.moe.experts) + \
                    2 * (layer.moe.shared_expert is not None)  # fmt: skip
        assert greedy(llm, prompts) == expected, backend


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_tp2_equals_tp1(arch, tiny_model_factory, prompts):
    path = str(tiny_model_factory(arch))
    engine = dict(dtype="float32", max_num_batched_tokens=32, kv_cache_memory_gb=0.02)
    with LLM(path, **engine) as one:
        ref = greedy(one, prompts)
    with LLM(path, tensor_parallel_size=2, **engine) as two:
        moe = two.engine.worker.model.layers[0].moe
        full = json.loads((Path(path) / "config.json").read_text())
        width = full["intermediate_size"] if arch == "mixtral" else full["moe_intermediate_size"]
        assert moe.experts[0].down_proj.in_features == width // 2
        if arch == "qwen2_moe":
            assert moe.shared_expert.down_proj.in_features == 64 // 2
        assert greedy(two, prompts) == ref


def test_adapters_of_the_attention_and_dense_layers_match_hf(tiny_model_factory, prompts,
                                                             tmp_path):  # fmt: skip
    from pagedserve.engine.errors import LoRAError
    from pagedserve.engine.lora.request import LoRALimits, LoRARequest, check_adapter
    from tests.helpers.lora import hf_greedy_with, make_adapter

    path = tiny_model_factory("qwen2_moe")  # layer 0: experts; layer 1: a dense MLP
    adapter = make_adapter(path, tmp_path / "a", rank=4, alpha=8, seed=3)
    names = load_file(adapter / "adapter_model.safetensors")
    assert any(".layers.1.mlp.gate_proj." in n for n in names)
    assert not any(".layers.0.mlp." in n for n in names)  # the experts take none
    ref = hf_greedy_with(path, adapter, prompts, 24)
    assert ref != hf_greedy_with(path, None, prompts, 24)
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_lora_rank=8,
              kv_cache_memory_gb=0.02)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24),
                        use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outs] == ref
    # An adapter of an expert layer's MLP is refused, naming the tensor.
    tensors = dict(names)
    tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] = torch.zeros(4, 32)
    tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"] = torch.zeros(64, 4)
    save_file(tensors, adapter / "adapter_model.safetensors")
    limits = LoRALimits.of(llm.engine.worker.spec, 8)
    # The GPU's reservation for an adapter is what the fullest one of this model takes
    # loaded: no MLP on the expert layer.
    from pagedserve.engine.lora.weights import load_lora

    full = make_adapter(path, tmp_path / "full", rank=8)
    w = load_lora(LoRARequest("full", 2, str(full)), limits, torch.float32, torch.device("cpu"))
    assert sum(t.numel() * t.element_size() for layer in w.layers for ab in layer.values()
               for t in ab) == limits.adapter_bytes(4)  # fmt: skip
    with pytest.raises(LoRAError, match=r"layers\.0\.mlp\.down_proj\.lora_.\.weight' adapts "
                                        r"layer 0's MLP, a mixture of experts"):  # fmt: skip
        check_adapter(adapter, limits)


def test_refusals_name_the_setting(tiny_model_factory, tmp_path):
    path = tiny_model_factory("qwen3_moe")
    spec = DecoderSpec.from_hf(_config(path))
    with pytest.raises(ValueError, match="quantization='gguf' is not supported for mixture"):
        check_moe(spec, "gguf")
    for quant in (None, "int8", "gptq", "awq"):
        check_moe(spec, quant)
    # An expert's tensor missing from the checkpoint.
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.1\.mlp\.experts\.5\.up_proj"):
        LLM(str(broken), kv_cache_memory_gb=0.02)
    # Tensors the model has no place for: an expert past num_experts, a dense MLP's
    # projection in a layer with experts, a router bias.
    for extra, shape in (("model.layers.0.mlp.experts.8.up_proj.weight", (32, 64)),
                         ("model.layers.0.mlp.gate_proj.weight", (128, 64)),
                         ("model.layers.0.mlp.gate.bias", (8,))):  # fmt: skip
        tensors = load_file(path / "model.safetensors")
        tensors[extra] = torch.zeros(shape)
        save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=rf"unexpected checkpoint tensor "
                                             rf"'{extra.removeprefix('model.')}'"):  # fmt: skip
            LLM(str(broken), kv_cache_memory_gb=0.02)
    # More experts per token than experts.
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be between 1 and "
                                         r"num_experts=8"):
        DecoderSpec.from_hf(_config(path, num_experts_per_tok=9))


def _config(path: Path, **changes):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


def test_tensor_parallel_widths_and_dense_configs(tiny_model_factory):
    from pagedserve.engine.models.shard import check_divisible

    path = tiny_model_factory("qwen2_moe")
    for key, value in (("moe_intermediate_size", 33), ("shared_expert_intermediate_size", 65)):
        spec = DecoderSpec.from_hf(_config(path, **{key: value}))
        with pytest.raises(ValueError, match=rf"tensor_parallel_size=2 .*{key}={value} is not "
                                             "divisible by it"):  # fmt: skip
            check_divisible(spec, 2)
    check_divisible(DecoderSpec.from_hf(_config(path)), 2)
    assert DecoderSpec.from_hf(_config(path, num_experts=0)).moe is None  # all layers dense


def test_mixtral_with_a_sliding_window_slides(tiny_model_factory, tmp_path):
    path = tmp_path / "windowed"
    shutil.copytree(tiny_model_factory("mixtral"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 16}))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02)
    assert llm.engine.settings.max_model_len == cfg["max_position_embeddings"]
    assert llm.engine.worker.model.spec.windows == (16, 16)
    ask = [[(13 * j + 5) % 20000 + 100 for j in range(n)] for n in (9, 50)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in ask], sp, use_tqdm=False)]  # fmt: skip
    assert got == hf_greedy(path, ask, 8)


def test_no_cuda_graphs_for_experts(tiny_model_factory):
    from types import SimpleNamespace

    from pagedserve.engine.worker.cuda_graphs import graphs_wanted

    llm = LLM(str(tiny_model_factory("mixtral")), kv_cache_memory_gb=0.02)
    triton_like = SimpleNamespace(name="triton")
    cuda = torch.device("cuda")
    dense = SimpleNamespace(spec=SimpleNamespace(moe=None))
    assert graphs_wanted(cuda, False, triton_like, dense)
    assert not graphs_wanted(cuda, False, triton_like, llm.engine.worker.model)
