"""An adapter's name, path and files checked before use (engine/lora/request.py): whatever
they hold, the answer is a :class:`LoRAError` naming the field or file and the limit
(never an ``OverflowError``, ``RecursionError`` or ``OSError``). Torch-free: the
adapters here are written by hand."""

from __future__ import annotations

import json
import struct

import pytest

from pagedserve import LoRARequest
from pagedserve.engine.lora import LoRAError, read_adapter_config
from pagedserve.engine.lora.request import (
    LoRALimits,
    check_adapter,
    check_lora_name,
    check_lora_path,
    header_limit,
)

LIMITS = LoRALimits(8, 2, (("q_proj", 64, 64), ("k_proj", 32, 64), ("v_proj", 32, 64),
                           ("o_proj", 64, 64), ("gate_proj", 128, 64), ("up_proj", 128, 64),
                           ("down_proj", 64, 128)))  # fmt: skip
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
DEEP = "[" * 5000 + "]" * 5000


def tensors(rank: int = 4) -> dict:
    """The safetensors header entries of a rank-``rank`` q_proj adapter of ``LIMITS``."""
    out, offset = {}, 0
    for layer in range(2):
        for ab, shape in (("A", [rank, 64]), ("B", [64, rank])):
            n = shape[0] * shape[1] * 4
            name = f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_{ab}.weight"
            out[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
    return out


def write(root, config: dict | str = CONFIG, header: dict | bytes | None = None):
    """An adapter directory: ``config`` (a dict, or the file's text) and a weights file of
    ``header`` (entries, or the header's raw bytes) with zero data."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(
        config if isinstance(config, str) else json.dumps(config))
    entries = tensors() if header is None else header
    raw = entries if isinstance(entries, bytes) else json.dumps(entries).encode()
    size = max((v["data_offsets"][1] for v in entries.values() if isinstance(v, dict)
                and "data_offsets" in v), default=0) if isinstance(entries, dict) else 0
    (root / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(raw)) + raw + bytes(size))
    return root


def test_a_well_formed_adapter_passes(tmp_path):
    cfg, found = check_adapter(write(tmp_path / "ok"), LIMITS)
    assert (cfg.rank, cfg.alpha, cfg.scaling) == (4, 8.0, 2.0)
    assert sorted(found) == [(0, "q_proj"), (1, "q_proj")]


@pytest.mark.parametrize("config, why", [
    ('{"r": 4, "lora_alpha": 1e400, "target_modules": ["q_proj"]}',
     "has a number out of range"),
    ('{"r": 4, "lora_alpha": 1' + "0" * 400 + ', "target_modules": ["q_proj"]}',
     "lora_alpha=10000000000"),
    ({**CONFIG, "lora_alpha": 70000}, "must be a finite number with |lora_alpha| <= 65536"),
    ('{"r": 4, "lora_alpha": NaN, "target_modules": ["q_proj"]}', "is not valid JSON"),
    ('{"r": 4, "lora_alpha": 8, "target_modules": ' + DEEP + "}",
     "is nested too deeply: arrays and objects may be nested at most 128 levels"),
    (json.dumps({**CONFIG, "pad": "x" * 2**20}), "is larger than the limit of 1048576 bytes"),
    ({**CONFIG, "use_rslora": [1]}, "use_rslora=[1]: must be true or false"),
    ({**CONFIG, "peft_type": "x" * 5000}, "(5002 characters): only LORA adapters"),
    ({**CONFIG, "r": 10**300}, "larger than max_lora_rank=8"),
    ('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]', "is not valid JSON"),
])
def test_bad_config_is_a_lora_error(tmp_path, config, why):
    path = write(tmp_path / "a", config)
    with pytest.raises(LoRAError) as e:
        read_adapter_config(path, 8)
    assert why in str(e.value) and len(str(e.value)) < 400, str(e.value)[:400]


@pytest.mark.parametrize("header, why", [
    (b'{"a": ' + DEEP.encode() + b"}", "is nested too deeply"),
    (b"[" * 100 + b"]" * 100 + b" " * 2**21, "the limit for an adapter of this model is "
                                             f"{header_limit(LIMITS)} bytes"),
    ({**tensors(), "__metadata__": {"pad": "x" * (2 * 2**20)}}, "the limit for an adapter"),
    ({"base_model.model.model.layers." + "9" * 5000 + ".self_attn.q_proj.lora_A.weight":
      {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}},
     "is not the lora_A/lora_B weight of a decoder layer"),
    ({**tensors(), "x": [1]}, "is not a readable safetensors file"),
    (b"[1, 2]", "is not a readable safetensors file: the header is not a JSON object"),
    (b'{"\\ud800": 1}', "is not valid JSON: the \\u escape at character 2 is a lone"),
    (b"\xff\xfe", "is not valid JSON"),
])
def test_bad_safetensors_header_is_a_lora_error(tmp_path, header, why):
    path = write(tmp_path / "a", header=header)
    with pytest.raises(LoRAError) as e:
        check_adapter(path, LIMITS)
    assert why in str(e.value) and len(str(e.value)) < 600, str(e.value)[:600]


def test_header_limit_scales_with_the_model():
    assert header_limit(LIMITS) == 2**20 + 2**10 * 14 * 2
    big = LoRALimits(8, 80, LIMITS.shapes)
    assert header_limit(big) > 2**20 + 80 * 14 * 200  # ~200 bytes a tensor in PEFT's files


@pytest.mark.parametrize("name, why", [
    ("\ud800", "U+D800 at index 0"),
    ("ok\x07", "U+0007 at index 2"),
    ("a\nb", "U+000A at index 1"),
    ("a\u2028b", "U+2028 at index 1"),
    ("x" * 257, "lora_name is 257 characters long; the limit is 256"),
    ("", "lora_name must be a non-empty string"),
    (5, "lora_name must be a non-empty string"),
])
def test_adapter_names_are_printable_text(name, why):
    with pytest.raises(LoRAError, match="lora_name") as e:
        check_lora_name(name)
    assert why in str(e.value)
    with pytest.raises(LoRAError, match="lora_name"):
        LoRARequest(name, 1, "/p")


def test_good_adapter_names():
    for name in ("sql", "org/model-lora v2", "é-ü", "x" * 256, "日本語"):
        assert check_lora_name(name) == name


@pytest.mark.parametrize("path, why", [
    ("/a" * 50000, "lora_path is 100000 bytes long; the limit is 4096 bytes"),
    ("/tmp/" + "x" * 256 + "/a", "lora_path has a name of 256 bytes; the limit is 255 bytes"),
    ("/tmp/a\x00b", "lora_path has the control character U+0000 at index 6"),
    ("/tmp/a\nb", "control character U+000A"),
    ("/tmp/\ud800", "lora_path has a lone surrogate at index 5"),
])
def test_adapter_paths_are_checked_before_the_file_system(path, why):
    with pytest.raises(LoRAError) as e:
        check_lora_path(path)
    assert why in str(e.value)
    with pytest.raises(LoRAError) as e:  # not an OSError (ENAMETOOLONG) or ValueError
        read_adapter_config(path, 8)
    assert why in str(e.value)


def test_good_adapter_paths(tmp_path):
    for path in ("/tmp/" + "x" * 255, "rel/é/dir", tmp_path):
        check_lora_path(path)


def test_a_path_the_file_system_refuses_is_a_lora_error(tmp_path, monkeypatch):
    from pathlib import Path

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", refuse)
    with pytest.raises(LoRAError, match="cannot be read: .*Permission denied"):
        read_adapter_config(tmp_path, 8)
