"""Tool-call parsing: any split of the model's text into stream pieces gives the calls
and content of the whole text."""

from __future__ import annotations

import codecs
import json

import pytest

from pagedserve.server.tool_parser import ToolCallParser

HERMES = (
    "Let me look that up ☀.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris } <tool_call>", "days": [1, 2]}}\n'
    "</tool_call>\n"
    '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris\\"x"}}</tool_call>\n'
    "Done."
)
WANT_CALLS = [("get_weather", '{"city": "Paris } <tool_call>", "days": [1, 2]}'),
              ("get_time", '{"tz": "Europe/Paris\\"x"}')]
REQUIRED = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "]}"}}]'


def run(mode: str, pieces: list[str], name: str | None = None):
    p = ToolCallParser(mode, name)
    content = ""
    calls: dict[int, dict] = {}
    for piece in [*pieces, None]:
        c, deltas = p.finish() if piece is None else p.feed(piece)
        content += c
        for d in deltas:
            if "id" in d:  # the first delta of a call: id, type and name
                assert d["index"] not in calls and d["type"] == "function"
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"],
                                     "arguments": d["function"]["arguments"]}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    out = [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)]
    assert out == [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls]
    return content, out, p


def byte_splits(text: str):
    """The text cut into two pieces at every byte position (as a UTF-8 stream would be
    decoded incrementally), and one byte at a time."""
    raw = text.encode()
    for cut in range(len(raw) + 1):
        dec = codecs.getincrementaldecoder("utf-8")()
        yield [dec.decode(raw[:cut]), dec.decode(raw[cut:], final=True)]
    dec = codecs.getincrementaldecoder("utf-8")()
    yield [dec.decode(raw[i:i + 1]) for i in range(len(raw))] + [dec.decode(b"", final=True)]


def test_hermes_whole_text():
    content, calls, p = run("hermes", [HERMES])
    assert content == "Let me look that up ☀.Done."
    assert calls == WANT_CALLS
    for _, args in calls:
        json.loads(args)
    assert p.final_content == content


@pytest.mark.parametrize("mode,text", [("hermes", HERMES), ("required", REQUIRED)])
def test_every_byte_split_gives_the_whole_parse(mode, text):
    whole = run(mode, [text])[:2]
    for pieces in byte_splits(text):
        got = run(mode, pieces)[:2]
        assert got == whole, pieces
        assert "<tool_call>" not in got[0] and "</tool" not in got[0]


def test_required_and_named():
    assert run("required", [REQUIRED])[:2] == ("", [("a", '{"x": 1}'), ("b", '{"y": "]}"}')])
    content, calls, p = run("named", ['{"city": ', '"Oslo"}'], name="get_weather")
    assert (content, calls, p.final_content) == ("", [("get_weather", '{"city": "Oslo"}')], None)


def test_plain_text_and_truncated_call():
    content, calls, p = run("hermes", ["Hello ", "world <b>", "\n"])
    assert (content, calls, p.final_content) == ("Hello world <b>\n", [], "Hello world <b>\n")
    # Cut by max_tokens inside the arguments: what was generated, as it streamed.
    content, calls, _ = run("hermes", ['Hi<tool_call>{"name": "f", "arguments": {"a": [1'])
    assert (content, calls) == ("Hi", [("f", '{"a": [1')])
