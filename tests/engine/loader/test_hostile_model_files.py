"""Malformed model files are refused at load with one ``ModelFileError`` naming the file,
what is wrong and the limit, before anything reads or allocates a declared size:

* GGUF files (converted to float, and served in their own blocks): truncated, tensors
  past the end of the file or overlapping, absurd dimensions and counts, arrays and
  strings longer than the file, model sizes its tensors do not have;
* safetensors checkpoints: header length bombs, headers that are not JSON or nested too
  deeply, data offsets out of range or overlapping, a dtype and shape that do not fill
  their byte range, and tensors whose shape is not the one the config gives;

a conversion that fails midway leaves nothing in the cache that a later load would take
for a converted model; and a chat template that raises is named at load and refuses each
conversation with its error.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM
from pagedserve.engine.errors import CheckpointShapeError, ModelFileError
from pagedserve.engine.loader import convert_gguf_model, default_gguf_path, default_model
from pagedserve.engine.loader.gguf_file import read_header
from tests.helpers.gguf_files import write_random_gguf

KV = 0.01
"""GiB of KV cache: the engines here never run."""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Conversions go to a cache of the test's own (the native kernels stay built in the
    user's)."""
    monkeypatch.setattr(default_model, "cache_root", lambda: tmp_path / "cache")


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> Path:
    """A small Llama GGUF file (Q8_0 weights, the default model's tokenizer)."""
    return write_random_gguf("llama", tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                             default_gguf_path(), types="Q8_0", hidden=64, inter=128,
                             layers=1, heads=2, kv_heads=1, head_dim=32)  # fmt: skip


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def _patched(src: Path, out: Path, at: int, fmt: str, value: int) -> Path:
    """A copy of ``src`` with ``value`` packed as ``fmt`` at byte ``at``."""
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, at, value)
    out.write_bytes(bytes(data))
    return out


def _after_key(data: bytes, key: str) -> int:
    """The offset just past the metadata key (or tensor name) ``key``."""
    return data.index(_string(key)) + len(_string(key))


def _tensor_info(data: bytes, name: str) -> int:
    """The offset of tensor ``name``'s dimension count in the header."""
    return _after_key(data, name)


def _gguf_cases(src: Path) -> dict[str, tuple[int, str, int, str]]:
    """Hostile edits of ``src``: (offset, struct format, value, the error's words)."""
    data = src.read_bytes()
    embd = _tensor_info(data, "token_embd.weight")  # n_dims, 2 dims, type, offset
    norm = _tensor_info(data, "output_norm.weight")
    tokens = _after_key(data, "tokenizer.ggml.tokens") + 8  # past the array's types
    types = _after_key(data, "tokenizer.ggml.token_type") + 8
    name = _after_key(data, "general.name") + 4  # past the value type
    return {
        "tensor count 2**60": (8, "<Q", 2**60, r"tensors: 1152921504606846976 declared; the "
                                               r"limit is 1048576"),
        "tensor count past the file": (8, "<Q", 2**19, r"tensors: 524288 declared, but the "
                                                       r"\d+ bytes left in the file hold at "
                                                       r"most \d+"),
        "metadata count 2**60": (16, "<Q", 2**60, r"metadata key/value pairs: "
                                                  r"1152921504606846976 declared; the limit"),
        "key length 2**60": (24, "<Q", 2**60, r"a metadata key is 1152921504606846976 bytes "
                                              r"long; the limit is 65535"),
        "string length 2**60": (name, "<Q", 2**60, r"the string value of general.name "
                                                   r"\(1152921504606846976 bytes\) needs "
                                                   r"1152921504606846976 bytes at offset \d+, "
                                                   r"past the end of the file"),
        "vocabulary of 2**40": (tokens, "<Q", 2**40, r"the array tokenizer.ggml.tokens: "
                                                     r"1099511627776 declared; the limit is "
                                                     r"16777216"),
        "vocabulary past the file": (tokens, "<Q", 2**23, r"the array tokenizer.ggml.tokens: "
                                                          r"8388608 declared, but the \d+ "
                                                          r"bytes left in the file hold at "
                                                          r"most \d+"),
        "metadata array of 2**60": (types, "<Q", 2**60, r"the array tokenizer.ggml.token_type: "
                                                         r"1152921504606846976 declared; the "
                                                         r"limit is 16777216"),
        "5 dimensions": (embd, "<I", 5, r"tensor 'token_embd.weight' has 5 dimensions; the "
                                        r"limit is 4"),
        "a dimension of 2**40": (embd + 12, "<Q", 2**40, r"tensor 'token_embd.weight' "
                                                         r"\(Q8_0, shape \[64, 1099511627776\]\) "
                                                         r"takes bytes \d+ to \d+, past the end "
                                                         r"of the file"),
        "2**65 elements": (embd + 4, "<Q", 2**50, r"tensor 'token_embd.weight' of shape "
                                                  r"\[1125899906842624, 49152\] has \d+ "
                                                  r"elements; the limit is 2\*\*63 - 1"),
        "offset past the file": (embd + 24, "<Q", 2**40, r"tensor 'token_embd.weight' "
                                                         r"\(Q8_0, shape \[64, 49152\]\) takes "
                                                         r"bytes \d+ to \d+, past the end"),
        "overlapping tensors": (norm + 16, "<Q", 0, r"tensors 'token_embd.weight' \(bytes \d+ "
                                                    r"to \d+\) and 'output_norm.weight' "
                                                    r"\(from \d+\) overlap"),
        "unknown tensor type": (embd + 20, "<I", 1000, r"tensor 'token_embd.weight' has GGML "
                                                       r"type 1000, which is not known"),
    }


def _gguf_case_ids() -> list[str]:
    return ["tensor count 2**60", "tensor count past the file", "metadata count 2**60",
            "key length 2**60", "string length 2**60", "vocabulary of 2**40",
            "vocabulary past the file", "metadata array of 2**60", "5 dimensions",
            "a dimension of 2**40", "2**65 elements", "offset past the file",
            "overlapping tensors", "unknown tensor type"]  # fmt: skip


@pytest.mark.parametrize("key, value, words", [
    ("llama.embedding_length", 2**31, r"llama.embedding_length=2147483648, but "
                                      r"token_embd.weight has rows of 64"),
    ("llama.block_count", 2**31, r"llama.block_count=2147483648, but the file has tensors of "
                                 r"1 blocks \(blk.0 to blk.0\)"),
    ("llama.attention.head_count", 0, r"llama.attention.head_count=0, but a count of heads is 1 "
                                      r"to embedding_length \(64\)"),
    ("llama.feed_forward_length", 2**31, r"llama.feed_forward_length=2147483648, but "
                                         r"blk.0.ffn_up.weight has 128 rows"),
    ("llama.context_length", 2**31, r"llama.context_length=2147483648, but the limit is "
                                    r"16777216"),
])  # fmt: skip
def test_model_sizes_the_tensors_do_not_have_are_refused(valid_gguf, tmp_path, key, value,
                                                         words):  # fmt: skip
    """The config is built from these (the engine allocates what they say before it reads a
    tensor): each must be what the tensors hold, and the context in bounds."""
    path = _patched(valid_gguf, tmp_path / "sizes.gguf",
                    _after_key(valid_gguf.read_bytes(), key) + 4, "<I", value)
    for quantization in (None, "gguf"):
        with pytest.raises(ModelFileError, match=rf"GGUF file '{path}': {words}"):
            LLM(str(path), quantization=quantization, dtype="float32", kv_cache_memory_gb=KV)
    assert _cache_entries(tmp_path) == []


def _cache_entries(tmp_path: Path) -> list[str]:
    models = tmp_path / "cache" / "models"
    return sorted(os.listdir(models)) if models.exists() else []


@pytest.mark.parametrize("case", _gguf_case_ids())
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_a_malformed_gguf_file_is_refused_naming_the_problem(valid_gguf, tmp_path, case,
                                                             quantization):  # fmt: skip
    at, fmt, value, words = _gguf_cases(valid_gguf)[case]
    path = _patched(valid_gguf, tmp_path / "hostile.gguf", at, fmt, value)
    start = time.monotonic()
    with pytest.raises(ModelFileError, match=rf"GGUF file '{path}': {words}"):
        LLM(str(path), quantization=quantization, dtype="float32", kv_cache_memory_gb=KV)
    assert time.monotonic() - start < 5
    assert _cache_entries(tmp_path) == []


@pytest.mark.parametrize("keep, words", [
    (12, r"is 12 bytes long: too short for a GGUF header \(24 bytes at least\)"),
    (20_000, r": the array tokenizer.ggml.tokens: 49152 declared, but the \d+ bytes left in "
             r"the file hold at most \d+: the file is truncated or corrupt"),
    (1_700_000, r": the (length of the )?string value of tokenizer.ggml.merges.* needs \d+ "
                r"bytes at offset \d+, past the end of the file \(1700000 bytes\): the file "
                r"is truncated"),
    (-1000, r": tensor '.*' \(.*\) takes bytes \d+ to \d+, past the end of the file \(\d+ "
            r"bytes\): the file is truncated or corrupt"),
])  # fmt: skip
def test_a_truncated_gguf_file_is_refused(valid_gguf, tmp_path, keep, words):
    path = tmp_path / "cut.gguf"
    path.write_bytes(valid_gguf.read_bytes()[:keep])
    for quantization in (None, "gguf"):
        with pytest.raises(ModelFileError, match=rf"GGUF file '{path}' ?{words}"):
            LLM(str(path), quantization=quantization, dtype="float32", kv_cache_memory_gb=KV)
    assert _cache_entries(tmp_path) == []


def test_the_bounded_header_reads_what_the_gguf_package_reads(valid_gguf):
    import gguf

    header = read_header(valid_gguf)
    theirs = gguf.GGUFReader(str(valid_gguf))
    assert [(t.name, t.shape, t.type_name, t.offset, t.nbytes) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type.name, t.data_offset, t.n_bytes)
        for t in theirs.tensors]
    assert header.fields["llama.embedding_length"] == 64
    assert header.fields["general.architecture"] == "llama"


def test_a_header_is_read_again_when_its_file_changes(valid_gguf, tmp_path):
    """Headers are kept per file version: the same file gives the same header, a file
    written again at the same path gives its own."""
    path = tmp_path / "m.gguf"
    shutil.copy(valid_gguf, path)
    first = read_header(path)
    assert read_header(path) is first and first.fields["llama.embedding_length"] == 64
    write_random_gguf("llama", path, default_gguf_path(), types="Q8_0", hidden=96,
                      inter=128, layers=1, heads=3, kv_heads=1, head_dim=32)  # fmt: skip
    assert read_header(path).fields["llama.embedding_length"] == 96
    path.write_bytes(valid_gguf.read_bytes()[:100])  # a bad version is refused, not cached
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        read_header(path)


def test_a_conversion_that_fails_midway_leaves_no_model_in_the_cache(valid_gguf, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """The weights are written, then the conversion fails: nothing a later load takes for a
    converted model is left (neither the target folder nor a temporary one), and the next
    load converts the file whole."""
    real = default_model._write_config
    written: list[Path] = []

    def fail_after_the_weights(gguf, out, config, arch):
        written.extend(out.iterdir())
        raise RuntimeError("disk full")

    monkeypatch.setattr(default_model, "_write_config", fail_after_the_weights)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf_model(valid_gguf)
    assert "model.safetensors" in {p.name for p in written}  # it failed midway
    assert _cache_entries(tmp_path) == []
    monkeypatch.setattr(default_model, "_write_config", real)
    folder = convert_gguf_model(valid_gguf, weights=False)
    assert default_model._is_complete(folder, False)
    assert _cache_entries(tmp_path) == [folder.name]


# -- safetensors --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


def _copy(tiny: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny, out)
    return out


def _split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write(path: Path, header: bytes, body: bytes, length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length)
                     + header + body)


def _edit_header(path: Path, edit) -> None:
    header, body = _split(path)
    edit(header)
    _write(path, json.dumps(header).encode(), body)


NORM0, NORM1 = ("model.layers.0.input_layernorm.weight",
                "model.layers.1.input_layernorm.weight")  # fmt: skip


def _offsets(name: str, begin: int, end: int):
    return lambda h: h[name].update(data_offsets=[begin, end])


SAFETENSORS_CASES = {
    "header length 2**60": (lambda p: _write(p, b"{}", b"", 2**60),
                            r"its header length field says 1152921504606846976 bytes; the "
                            r"limit is 100000000"),
    "header length past the file": (lambda p: _write(p, b"{}", b"", 5000),
                                    r"its header length field says 5000 bytes, but only 2 "
                                    r"follow it: the file is truncated"),
    "header not JSON": (lambda p: _write(p, b"{'not': json}", b""),
                        r"its header is not JSON: Expecting property name"),
    "header nested deeply": (lambda p: _write(p, b"[" * 100_000 + b"]" * 100_000, b""),
                             r"its header is JSON nested too deeply"),
    "header not an object": (lambda p: _write(p, b"[1, 2]", b""),
                             r"its header is a JSON list, not an object"),
    "offsets past the data": (lambda p: _edit_header(p, lambda h: h[NORM0].update(
        data_offsets=[2**40, 2**40 + 256])), r"tensor 'model.layers.0.input_layernorm.weight' "
                                             r"has data_offsets \[1099511627776, "
                                             r"1099511628032\], past the end of the data "
                                             r"section \(\d+ bytes\)"),
    "overlapping tensors": (lambda p: _edit_header(p, lambda h: h[NORM1].update(
        data_offsets=h[NORM0]["data_offsets"])), r"tensor 'model.layers.[01].input_layernorm."
                                                 r"weight' \(bytes \d+ to \d+\) overlaps the "
                                                 r"tensor before it"),
    "shape of 2**40": (lambda p: _edit_header(p, lambda h: h[NORM0].update(shape=[2**40])),
                       r"tensor 'model.layers.0.input_layernorm.weight' of dtype F32 and shape "
                       r"\[1099511627776\] takes 4398046511104 bytes, but its data_offsets "
                       r"\[\d+, \d+\] span 256"),
    "dtype of another size": (lambda p: _edit_header(p, lambda h: h[NORM0].update(
        dtype="F16")), r"tensor 'model.layers.0.input_layernorm.weight' of dtype F16 and shape \[64\] takes 128 bytes, but its data_offsets "
                       r"\[\d+, \d+\] span 256"),
    "unknown dtype": (lambda p: _edit_header(p, lambda h: h[NORM0].update(dtype="F128")),
                      r"tensor 'model.layers.0.input_layernorm.weight' has dtype 'F128', not a "
                      r"safetensors dtype \(BOOL, U8, .*\)"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_a_malformed_safetensors_file_is_refused_naming_the_problem(tiny, tmp_path, case):
    edit, words = SAFETENSORS_CASES[case]
    path = _copy(tiny, tmp_path)
    file = path / "model.safetensors"
    edit(file)
    start = time.monotonic()
    with pytest.raises(ModelFileError, match=rf"safetensors file '{file}': {words}"):
        LLM(str(path), kv_cache_memory_gb=KV)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.q_proj.weight", (32, 64)),  # fewer rows: k's would follow
    ("model.layers.0.self_attn.k_proj.weight", (64, 64)),  # more: into v's
    ("model.layers.1.mlp.down_proj.weight", (64, 64)),
    ("model.layers.0.input_layernorm.weight", (1,)),  # would broadcast
    ("model.embed_tokens.weight", (49152, 32)),
])  # fmt: skip
def test_a_tensor_of_another_shape_than_the_config_gives_is_refused(tiny, tmp_path, name,
                                                                    shape):  # fmt: skip
    path = _copy(tiny, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    want = list(tensors[name].shape)
    tensors[name] = torch.zeros(shape)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    short = name.removeprefix("model.")
    with pytest.raises(CheckpointShapeError,
                       match=rf"{path / 'model.safetensors'}: checkpoint tensor '{short}' has "
                             rf"shape \[{', '.join(map(str, shape))}\], but the model's config "
                             rf"gives it shape \[{', '.join(map(str, want))}\]"):  # fmt: skip
        LLM(str(path), kv_cache_memory_gb=KV)


# -- a chat template that raises ----------------------------------------------------------
BROKEN_TEMPLATE = "{{ raise_exception('this template renders nothing') }}"


@pytest.fixture(scope="module")
def broken_template_gguf(tiny_model_factory, tmp_path_factory) -> Path:
    """The tiny Gemma 3 as a GGUF file whose chat template raises whatever it renders."""
    from tests.helpers.gguf_files import write_gemma3_gguf

    return write_gemma3_gguf(tiny_model_factory("gemma3_6"),
                             tmp_path_factory.mktemp("gguf") / "broken-template.gguf",
                             default_gguf_path(), chat_template=BROKEN_TEMPLATE)  # fmt: skip


def test_a_chat_template_that_raises_is_named_at_load_and_refuses_each_chat(
        broken_template_gguf, caplog):  # fmt: skip
    """The model loads (its prompts need no template) and the load warns, naming the
    template's error; each conversation is refused with the template's error (the server:
    a 400, ``tests/server/test_gguf_server.py``)."""
    import jinja2

    from pagedserve import SamplingParams

    with caplog.at_level("WARNING", logger="pagedserve.engine.loader.model_files"):
        llm = LLM(str(broken_template_gguf), quantization="gguf", kv_cache_memory_gb=KV)
    assert [r for r in caplog.records if "the chat template of" in r.getMessage()
            and "this template renders nothing" in r.getMessage()]  # fmt: skip
    with pytest.raises(jinja2.TemplateError, match="this template renders nothing"):
        llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    out = llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
