"""JSON text inside a request, and values of the wrong type, checked where the server reads
them (no server needed): each is a 400 naming the field and the limit."""

from __future__ import annotations

import pytest

from pagedserve.engine.lora import LoRAError
from pagedserve.server.errors import APIError
from pagedserve.server.lora import LoRAAdapters, LoRAModule, LoRANameError, parse_lora_module
from pagedserve.server.prompts import messages_to_dicts
from pagedserve.server.protocol import ChatMessage
from pagedserve.server.responses_input import input_messages

DEEP = "[" * 5000 + "]" * 5000


def _call(arguments) -> list[ChatMessage]:
    return [ChatMessage("user", "hi"), ChatMessage("assistant", None, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}])]


@pytest.mark.parametrize("arguments, why", [
    (DEEP, "messages[1].tool_calls[0].function.arguments is nested too deeply: arrays and "
           "objects may be nested at most 128 levels"),
    ('{"a": NaN}', "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    ('{"a": 1e999}', "messages[1].tool_calls[0].function.arguments has a number out of range: "
                     "a number may not be past float64's range"),
    ('{"a": "\\udc00"}', "messages[1].tool_calls[0].function.arguments is not valid JSON: the "
                         "\\u escape at character 7 is a lone surrogate"),
])
def test_tool_call_arguments_are_bounded(arguments, why):
    with pytest.raises(APIError) as e:
        messages_to_dicts(_call(arguments))
    assert (e.value.status, e.value.param) == (400, "messages")
    assert e.value.message.startswith(why), e.value.message


def test_tool_call_arguments_decode_to_an_object():
    out = messages_to_dicts(_call('{"city": "Paris", "days": [1, 2]}'))
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": [1, 2]}


@pytest.mark.parametrize("item_id, kind", [(["x"], "an array"), ({"a": 1}, "an object"),
                                           (5, "a number"), (True, "a boolean")])
def test_responses_item_id_must_be_a_string(item_id, kind):
    for item in ({"role": "user", "content": "hi", "id": item_id},
                 {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                  "id": item_id}):
        with pytest.raises(APIError) as e:
            input_messages([{"role": "user", "content": "q"}, item], None)
        assert (e.value.status, e.value.param) == (400, "input")
        assert e.value.message == f"input[1].id must be a string, got {kind}"
    assert len(input_messages([{"role": "user", "content": "hi", "id": "msg_1"},
                               {"role": "user", "content": "hi", "id": None}], None)) == 2


def test_lora_module_names_and_json_are_checked(tmp_path):
    """``--lora-modules`` as the command line gives it (a name of bytes that are not
    UTF-8 arrives with lone surrogates) and its JSON form."""
    adapters = LoRAAdapters((), ("base",), 8)
    for name, why in (("\udcff", "U+DCFF at index 0"), ("a\tb", "U+0009 at index 1"),
                      ("x" * 300, "the limit is 256")):  # fmt: skip
        with pytest.raises(LoRANameError, match="lora_name") as e:
            adapters.add(LoRAModule(name, str(tmp_path)))
        assert why in str(e.value)
    with pytest.raises(LoRAError, match="lora_path is 100000 bytes long; the limit is 4096"):
        adapters.add(LoRAModule("ok", "/a" * 50000))
    assert adapters.by_name == {}
    with pytest.raises(ValueError, match="is nested too deeply"):
        parse_lora_module('{"name": "a", "path": ' + DEEP + "}")
