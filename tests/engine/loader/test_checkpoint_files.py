"""GPTQ and AWQ checkpoint files as they come: bit patterns worked out by hand from the
formats' definitions, the older settings files, shards, and every file that cannot be
served refused with an error naming the setting or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.engine.errors import CheckpointQuantError
from pagedserve.engine.loader.checkpoint_quant import CheckpointQuant
from pagedserve.engine.loader.checkpoint_weights import _decode
from tests.helpers.quantized_checkpoints import Scheme, split_into_shards, write_quantized

KV = 0.05


@pytest.fixture(scope="module")
def made(tiny_model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    src = tiny_model_factory("llama")
    write_quantized(src, root / "gptq", root / "gptq-ref", Scheme(group_size=32))
    write_quantized(src, root / "awq", root / "awq-ref",
                    Scheme(method="awq", group_size=32, sym=False))
    return root


def _copy(made, name: str, tmp_path):
    return shutil.copytree(made / name, tmp_path / name)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _tokens(path, prompts=((1, 500, 600, 700),)):
    llm = LLM(str(path), kv_cache_memory_gb=KV)
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_known_packings():
    # AWQ: field p (bits 4p..4p+3) of an int32 holds column (0, 2, 4, 6, 1, 3, 5, 7)[p].
    awq = CheckpointQuant("awq", 4, -1, False, False, False)
    lin = _decode(awq, "m", {"qweight": torch.tensor([[0x75316420]], dtype=torch.int32),
                             "qzeros": torch.tensor([[0x76543210]], dtype=torch.int32),
                             "scales": torch.ones(1, 8, dtype=torch.float16)})
    assert lin.codes[:, 0].tolist() == list(range(8))
    assert lin.zeros[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    # GPTQ: codes along the input dimension and zero points along the output one, lowest
    # bits first; the original format stores zero - 1 in the field (a zero of 0 as 15).
    gptq = CheckpointQuant("gptq", 4, -1, False, False, True)
    lin = _decode(gptq, "m", {"qweight": torch.tensor([[0x76543210 + i] for i in range(8)],
                                                      dtype=torch.int32).T.contiguous(),
                              "qzeros": torch.tensor([[-0x09ABCDF0]], dtype=torch.int32),
                              "scales": torch.full((1, 8), 0.5, dtype=torch.float16)})
    # 0xF6543210 as int32: fields 0, 1, 2, 3, 4, 5, 6, 15 -> zeros 1, 2, ..., 7, 0
    assert lin.zeros[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert lin.codes[3].tolist() == [3, 1, 2, 3, 4, 5, 6, 7]
    assert lin.dequantize()[7].tolist() == [0.5 * c for c in (7, 1, 2, 3, 4, 5, 6, 7)]
    v2 = CheckpointQuant("gptq", 4, -1, False, False, False)
    assert _decode(v2, "m", {"qweight": torch.zeros(1, 8, dtype=torch.int32),
                             "qzeros": torch.tensor([[0x76543210]], dtype=torch.int32),
                             "scales": torch.ones(1, 8, dtype=torch.float16)},
                   ).zeros[:, 0].tolist() == list(range(8))


def test_settings_in_the_older_files(made, tmp_path):
    """Older AutoGPTQ / AutoAWQ folders: no quantization_config in config.json, the
    settings in quantize_config.json / quant_config.json (AutoAWQ's own key names)."""
    want = {name: _tokens(made / name) for name in ("gptq", "awq")}
    for name, file, settings in (
            ("gptq", "quantize_config.json", {"bits": 4, "group_size": 32, "desc_act": False,
                                              "sym": True}),
            ("awq", "quant_config.json", {"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                          "version": "GEMM"})):
        path = _copy(made, name, tmp_path)
        cfg = json.loads((path / "config.json").read_text())
        del cfg["quantization_config"]
        (path / "config.json").write_text(json.dumps(cfg))
        (path / file).write_text(json.dumps(settings))
        assert _tokens(path) == want[name], file
        (path / file).write_text(json.dumps({**settings, "group_size": 64, "q_group_size": 64}))
        with pytest.raises(CheckpointQuantError, match=rf"but {file}.group_size=64 makes"):
            LLM(str(path), kv_cache_memory_gb=KV)


def test_a_linear_split_across_shards(made, tmp_path):
    path = _copy(made, "gptq", tmp_path)
    split_into_shards(path, 3)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = {index[f"model.layers.0.self_attn.q_proj.{p}"] for p in ("qweight", "qzeros", "scales")}
    assert len(files) > 1
    assert _tokens(path) == _tokens(made / "gptq")


@pytest.mark.parametrize(("name", "changes", "message"), [
    ("gptq", {"bits": 3}, r"quantization_config.bits=3: GPTQ checkpoints of 2, 4 or 8 bits"),
    ("gptq", {"checkpoint_format": "marlin"}, r"quantization_config.checkpoint_format='marlin'"),
    ("gptq", {"is_marlin_format": True}, r"checkpoint_format=marlin \(is_marlin_format\)"),
    ("gptq", {"pack_dtype": "int16"}, r"quantization_config.pack_dtype='int16'"),
    ("gptq", {"group_size": 0}, r"quantization_config.group_size=0"),
    ("gptq", {"group_size": 64}, r"groups of scales for \d+ input columns, but "
                                 r"quantization_config.group_size=64 makes"),
    ("gptq", {"quant_method": "fp8"}, r"quant_method='fp8', which is not supported"),
    ("awq", {"version": "gemv"}, r"quantization_config.version='gemv'"),
])
def test_unsupported_checkpoints_are_refused(made, tmp_path, name, changes, message):
    path = _copy(made, name, tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(CheckpointQuantError, match=message):
        LLM(str(path), kv_cache_memory_gb=KV)


def _edit_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_bad_tensors_are_refused(made, tmp_path):
    # An all-zero bias of a projection without one (GPTQ writes them) loads; another not.
    path = _copy(made, "gptq", tmp_path)
    name = "model.layers.1.self_attn.o_proj.bias"
    _edit_tensors(path, lambda t: t.update({name: torch.zeros(64, dtype=torch.float16)}))
    assert _tokens(path) == _tokens(made / "gptq")
    _edit_tensors(path, lambda t: t.update({name: torch.full((64,), 0.5, dtype=torch.float16)}))
    with pytest.raises(CheckpointQuantError, match=rf"{name}.*has none for.*not all zero"):
        LLM(str(path), kv_cache_memory_gb=KV)
    # Parts missing, or packed in another integer type.
    path = _copy(made, "awq", tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.0.mlp.down_proj.qzeros"))
    with pytest.raises(CheckpointQuantError, match=r"down_proj' has qweight, scales but no qzeros"):
        LLM(str(path), kv_cache_memory_gb=KV)
    _edit_tensors(path, lambda t: t.update({"model.layers.0.mlp.down_proj.qzeros": torch.zeros(
        4, 8, dtype=torch.int16)}))
    with pytest.raises(CheckpointQuantError, match=r"qzeros is torch.int16, not int32"):
        LLM(str(path), kv_cache_memory_gb=KV)


def test_quantized_tensors_without_settings_are_refused(made, tmp_path):
    path = _copy(made, "gptq", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"part of a quantized linear, but the model's config "
                                         r"names no quantization"):
        LLM(str(path), kv_cache_memory_gb=KV)
