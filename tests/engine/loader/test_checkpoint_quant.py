"""GPTQ and AWQ checkpoints: their weights load in the native quantized formats (exactly
where the format allows it), greedy output equals HF transformers on the checkpoint's
dequantized weights, and every checkpoint that cannot be served is refused with an error
naming the setting."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pagedserve import LLM, EngineConfig, SamplingParams
from pagedserve.engine.errors import CheckpointQuantError
from pagedserve.engine.loader import load_config
from pagedserve.engine.loader.checkpoint_quant import CheckpointQuant, read_quantization_config
from pagedserve.engine.loader.checkpoint_weights import iter_checkpoint_weights, tensor_layout
from pagedserve.engine.models.checkpoint_names import layout_key
from pagedserve.engine.models.decoder import LINEAR_NAMES
from pagedserve.engine.models.spec import DecoderSpec
from pagedserve.kernels.quant import QuantizedWeight
from tests.helpers.hf import hf_greedy
from tests.helpers.prompts import TINY_MODEL_TEXTS
from tests.helpers.quantized_checkpoints import Scheme, tied_copy, write_quantized

NEW = 12

FUSED_IN = {f"layers.{i}.{p}" for i in range(2) for p in ("qkv_proj", "gate_up_proj")}
SCHEMES = {
    # name: (architecture, scheme, the native format its linears load in (None: float32),
    #        the projections that load as float32 all the same)
    "gptq4-sym": ("llama", Scheme(group_size=32, extra_bias=True), "q4_0", set()),
    "gptq4-zeros-v2": ("llama", Scheme(group_size=64, sym=False, checkpoint_format="gptq_v2"),
                       "q4_1", set()),
    "gptq4-zeros-v1": ("qwen3", Scheme(group_size=32, sym=False), "q4_1", set()),
    "gptq4-partly-float": ("llama", Scheme(group_size=32, unquantized=(
        "model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj")), "q4_0",
        {"layers.1.qkv_proj", "layers.0.down_proj"}),
    "gptq4-act-order": ("llama", Scheme(group_size=32, desc_act=True), "q4_0", set()),
    "gptq4-act-order-zeros": ("qwen2", Scheme(group_size=32, desc_act=True, sym=False,
                                              checkpoint_format="gptq_v2"), "q4_1", set()),
    "gptq4-act-order-unshared": ("llama", Scheme(group_size=32, desc_act=True,
                                                 shared_act_order=False), "q4_0", FUSED_IN),
    "gptq8-sym-per-row": ("llama", Scheme(bits=8, group_size=-1), "q8_0", set()),
    "gptq8-zeros": ("llama", Scheme(bits=8, group_size=32, sym=False), None, set()),
    "awq": ("llama", Scheme(method="awq", group_size=32, sym=False), "q4_1", set()),
    "awq-qwen2": ("qwen2", Scheme(method="awq", group_size=64, sym=False), "q4_1", set()),
    "awq-tied": ("llama-tied", Scheme(method="awq", group_size=32, sym=False), "q4_1", set()),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory, tmp_path_factory):
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            arch, scheme, _, _ = SCHEMES[name]
            root = tmp_path_factory.mktemp(name)
            src = tiny_model_factory(arch.removesuffix("-tied"))
            if arch.endswith("-tied"):
                src = tied_copy(src, root / "tied")
            exact = write_quantized(src, root / "q", root / "ref", scheme)
            made[name] = (root / "q", root / "ref", exact)
        return made[name]

    return get


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [default_tokenizer.encode(t) for t in TINY_MODEL_TEXTS]


def _loaded(path):
    cfg = load_config(path)
    quant = CheckpointQuant.from_config(read_quantization_config(cfg, path))
    layout = tensor_layout(path, quant)
    weights = iter_checkpoint_weights(path, quant, layout, DecoderSpec.from_hf(cfg))
    return dict(weights), layout


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_weights_load_in_their_format(checkpoints, name):
    quantized, ref, exact = checkpoints(name)
    _, scheme, expected_fmt, floats = SCHEMES[name]
    weights, layout = _loaded(quantized)
    reference = load_file(str(ref / "model.safetensors"))
    assert set(weights) == set(reference)
    every = {f"layers.{i}.{p}" for i in range(2) for p in LINEAR_NAMES}
    assert layout.formats == ({k: expected_fmt for k in every - floats} if expected_fmt else {})
    # act-order: every kept projection's columns are reordered, the same for its parts
    assert set(layout.orders) == (set(layout.formats) if scheme.desc_act else set())
    for key, ref_w in reference.items():
        got = weights[key]
        if not key.endswith("_proj.weight"):
            assert torch.equal(got.float(), ref_w.float()), key
            continue
        if layout.formats.get(layout_key(key)) is None:
            assert isinstance(got, torch.Tensor) and torch.equal(got, exact[key]), key
            continue
        assert isinstance(got, QuantizedWeight) and got.fmt == expected_fmt, key
        order = layout.orders.get(layout_key(key), torch.arange(ref_w.shape[1]))
        deq = got.dequantize()
        assert torch.equal(deq, ref_w[:, order]), key
        if expected_fmt == "q4_1":  # the offset -scale * zero is rounded to float16
            bound = got.m.float().abs().repeat_interleave(32, dim=1) * 2**-11
            assert ((deq - exact[key][:, order]).abs() <= bound).all(), key
        else:
            assert torch.equal(deq, exact[key][:, order]), key


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_equals_hf_on_the_dequantized_weights(checkpoints, prompts, name, backend):
    quantized, ref, _ = checkpoints(name)
    expected = hf_greedy(ref, prompts, NEW)
    llm = LLM(str(quantized), attention_backend=backend, kv_cache_memory_gb=0.05,
              quantized_activations="float")
    worker = llm.engine.worker
    _, scheme, fmt, floats = SCHEMES[name]
    assert worker.settings.quantization == scheme.method and worker.settings.dtype == torch.float32
    o_proj = worker.model.layers[0].o_proj
    assert (o_proj.weight.fmt if isinstance(o_proj.weight, QuantizedWeight) else None) == fmt
    assert worker.quant_desc.endswith(f"({fmt or 'float32'})")
    assert (getattr(o_proj, "input_order", None) is not None) == scheme.desc_act
    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks


def test_quantization_setting_against_the_checkpoint(checkpoints, tiny_model_factory):
    quantized = checkpoints("gptq4-sym")[0]
    with pytest.raises(CheckpointQuantError, match=r"quantization='awq', but .* gptq checkpoint"):
        LLM(str(quantized), quantization="awq", kv_cache_memory_gb=0.05)
    with pytest.raises(CheckpointQuantError, match=r"quantization='int8', but .* gptq checkpoint"):
        LLM(str(quantized), quantization="int8", kv_cache_memory_gb=0.05)
    with pytest.raises(CheckpointQuantError, match=r"quantization='gptq' needs a GPTQ checkpoint"):
        LLM(str(tiny_model_factory("llama")), quantization="gptq", kv_cache_memory_gb=0.05)
    with pytest.raises(CheckpointQuantError, match=r"dtype='bfloat16': .* float32"):
        LLM(str(quantized), dtype="bfloat16", kv_cache_memory_gb=0.05)
    with pytest.raises(CheckpointQuantError, match=r"tensor_parallel_size=2: .* one rank"):
        LLM(str(quantized), tensor_parallel_size=2, kv_cache_memory_gb=0.05)
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*quantization='gptq' runs on one"):
        EngineConfig(quantization="gptq", tensor_parallel_size=2)
    # Named explicitly, as the checkpoint says: served the same.
    assert LLM(str(quantized), quantization="gptq",
               kv_cache_memory_gb=0.05).engine.settings.quantization == "gptq"
