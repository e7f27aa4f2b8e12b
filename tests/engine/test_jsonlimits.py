"""Bounded JSON decoding (engine/jsonlimits.py) and the call sites that decode a client's
or a file's JSON text with it: every malformed, oversized or deeply nested text is a
clear error naming the field and the limit, never a ``RecursionError``."""

from __future__ import annotations

import pytest

from pagedserve import StructuredOutputsError, StructuredOutputsParams
from pagedserve.engine.core.pooling import pooling_defaults
from pagedserve.engine.errors import JSONTextError
from pagedserve.engine.jsonlimits import MAX_DEPTH, decode_json, read_json_file
from pagedserve.engine.loop.engine_info import generation_defaults
from pagedserve.engine.speculative import SpeculativeConfig

DEEP = "[" * 5000 + "]" * 5000
"""Past the interpreter's recursion limit: a RecursionError from a plain decoder."""


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("text, why", [
    (DEEP, "nested too deeply: arrays and objects may be nested at most 128 levels"),
    (nested(MAX_DEPTH + 1), "at most 128 levels"),
    ('{"a": ' * 200 + "1" + "}" * 200, "at most 128 levels"),
    ("[NaN]", "is not valid JSON"),
    ('{"lora_alpha": 1e400}', "has a number out of range"),
    ("[" + "7" * 5000 + "]", "has a number out of range"),
    ('{"a": "\\ud800"}', "the \\u escape at character 7 is a lone surrogate"),
    ('"\\udc00\\ud800"', "at character 1 is a lone surrogate"),
    ("{bad", "is not valid JSON"),
    ("x" * (4 * 2**20 + 1), "is 4194305 characters long; the limit is 4194304 characters"),
])
def test_bad_text_is_an_error_naming_the_field_and_limit(text, why):
    with pytest.raises(JSONTextError) as e:
        decode_json(text, "the_field")
    assert str(e.value).startswith("the_field ") and why in str(e.value), str(e.value)
    assert e.value.field == "the_field" and isinstance(e.value, ValueError)


def test_good_text_decodes_as_json():
    assert decode_json(nested(MAX_DEPTH), "f") is not None
    assert decode_json('{"b": 1, "a": [2.5, "\\ud83d\\ude00", "\\\\ud800"]}', "f") == {
        "b": 1, "a": [2.5, "\U0001f600", "\\ud800"]}
    assert list(decode_json('{"z": 1, "a": 2}', "f")) == ["z", "a"]  # order kept
    assert decode_json(b'{"a": 1}', "f", max_size=8) == {"a": 1}
    with pytest.raises(JSONTextError, match="is 9 bytes long; the limit is 8 bytes"):
        decode_json(b'{"a": 12}', "f", max_size=8)


def test_files_are_read_up_to_their_limit(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"a": 1}' + " " * 100)
    assert read_json_file(f) == {"a": 1}
    with pytest.raises(JSONTextError, match=r"c\.json is larger than the limit of 64 bytes"):
        read_json_file(f, max_bytes=64)
    f.write_text(DEEP)
    with pytest.raises(JSONTextError, match=r"c\.json is nested too deeply"):
        read_json_file(f)


def test_schema_strings_are_bounded():
    with pytest.raises(StructuredOutputsError) as e:
        StructuredOutputsParams(json=DEEP)
    assert e.value.kind == "json"
    assert str(e.value) == ("structured_outputs.json is nested too deeply: arrays and objects "
                            "may be nested at most 128 levels")
    with pytest.raises(StructuredOutputsError, match=r"structured_outputs\.json is not valid "
                                                     "JSON: the .u escape at character 2"):
        StructuredOutputsParams(json='{"\\udfff": 1}')
    assert StructuredOutputsParams(json='{"type": "object"}').json == '{"type":"object"}'


def test_speculative_config_string_is_bounded():
    with pytest.raises(ValueError, match="speculative_config is nested too deeply"):
        SpeculativeConfig.parse('{"method": ' + DEEP + "}")


def test_model_json_files_past_their_limits_are_ignored(tmp_path):
    """A model's generation_config.json or sentence-transformers files nested too deeply
    are skipped as malformed ones are (the defaults stay empty), not a crash at start."""
    (tmp_path / "generation_config.json").write_text('{"temperature": ' + DEEP + "}")
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "modules.json").write_text(DEEP)
    assert pooling_defaults(tmp_path).pooling_type is None
