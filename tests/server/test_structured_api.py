"""Structured outputs and tool calling through the real ``openai`` SDK against
``pagedserve serve`` on the default model."""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Annotated

import jsonschema
import pydantic
import pytest
import requests

from tests.helpers.server import ServerProcess

SCHEDULE_FIRST = True
"""Among the longest modules of the suite: started first (``tests/conftest.py``)."""

TEMPLATE = Path(__file__).parent / "data" / "tools_template.jinja"
ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25", "--max-model-len",
        "2048", "--dtype", "float32", "--log-level", "warning", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--chat-template", str(TEMPLATE)]
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Za-z/]{1,20}$"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^[A-Za-z ]{1,20}$")
    zip_code: int = pydantic.Field(ge=0, le=99999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[A-Za-z ]{1,20}$")
    age: int = pydantic.Field(ge=0, le=120)
    favourite: Color
    hobbies: list[Annotated[str, pydantic.Field(pattern="^[a-z ]{1,16}$")]] = \
        pydantic.Field(max_length=3)
    address: Address
    nickname: str | None = None


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def ask(text):
    return [{"role": "user", "content": text}]


def test_parse_pydantic_model_on_ten_prompts(client):
    for i in range(10):
        r = client.chat.completions.parse(
            model=MODEL, messages=ask(f"Invent person number {i} as JSON."),
            response_format=Person, temperature=0.7, seed=i, max_completion_tokens=300)
        assert isinstance(r.choices[0].message.parsed, Person), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"


def test_json_schema_streamed_and_whole(client):
    schema = Person.model_json_schema()
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=ask("A person:"),
                                           response_format=rf, temperature=0, max_tokens=300)
    text = whole.choices[0].message.content
    Person.model_validate_json(text)
    stream = client.chat.completions.create(model=MODEL, messages=ask("A person:"),
                                            response_format=rf, temperature=0, max_tokens=300,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_guided_choice_and_regex_at_temperature_one(client):
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt="Is the sky blue?", n=4,
                                      temperature=1.0, max_tokens=20,
                                      extra_body={"guided_choice": ["yes", "no", "perhaps"]})
        assert all(c.text in ("yes", "no", "perhaps") for c in r.choices)
        r = client.chat.completions.create(
            model=MODEL, messages=ask("A phone number?"), n=4, temperature=1.0, max_tokens=30,
            extra_body={"guided_regex": r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"})
        for c in r.choices:
            assert re.fullmatch(r"\+[0-9]{2} [0-9]{3}-[0-9]{4}", c.message.content)
    r = client.completions.create(model=MODEL, prompt="Color:", max_tokens=10, n=3,
                                  extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert {c.text for c in r.choices} <= {"a", "b"}


def assemble(stream):
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        for ch in chunk.choices:
            assert not ch.delta.content or "<tool_call>" not in ch.delta.content
            for d in ch.delta.tool_calls or []:
                if d.id is not None:
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            reason = ch.finish_reason or reason
    return [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_required_and_named_calls_validate(client, choice):
    msgs = ask("What is the weather in Paris, and the time in Tokyo?")
    kw = dict(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, temperature=0,
              max_tokens=200)
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.tool_calls
    got = [(c.function.name, c.function.arguments) for c in m.tool_calls]
    for name, args in got:
        jsonschema.validate(json.loads(args), SCHEMAS[name])
        assert isinstance(choice, str) or name == "get_time"
    assert all(c.id.startswith("call_") and c.type == "function" for c in m.tool_calls)
    streamed, reason = assemble(client.chat.completions.create(**kw, stream=True))
    assert streamed == got and reason == "tool_calls"


def test_tool_round_trip_history(client):
    msgs = [*ask("Weather in Oslo?"),
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snow"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=20)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    tok = requests.post(client.base_url.__str__().removesuffix("/v1/") + "/tokenize",
                        json={"messages": msgs}, timeout=60)
    assert tok.status_code == 200


def test_auto_runs_and_parses(client):
    kw = dict(model=MODEL, messages=ask("Weather in Rome?"), tools=TOOLS, temperature=0,
              max_tokens=60)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed, _ = assemble(client.chat.completions.create(**kw, stream=True))
    assert streamed == [(c.function.name, c.function.arguments)
                        for c in whole.message.tool_calls or []]
    assert "<tool_call>" not in (whole.message.content or "")


DEEP = "[" * 5000 + "]" * 5000
"""A schema string nested past the interpreter's recursion limit."""
TOO_DEEP = "is nested too deeply: arrays and objects may be nested at most 128 levels"
DEEP_SCHEMA: dict = {"type": "string"}
"""A schema object nested past 128 levels (as a JSON object, not a string)."""
for _ in range(100):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}}
BAD = [
    ({"guided_json": DEEP}, "guided_json", f"guided_json {TOO_DEEP}"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
     "response_format", f"response_format.json_schema.schema {TOO_DEEP}"),
    ({"structured_outputs": {"json": DEEP}}, "structured_outputs",
     f"structured_outputs.json {TOO_DEEP}"),
    ({"guided_json": '{"type": "object", "maxProperties": 1e400}'}, "guided_json",
     "guided_json has a number out of range"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "frob"}}}},
     "response_format", "response_format.json_schema.schema cannot be compiled: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     "response_format", "cannot be compiled"),
    ({"guided_regex": "(open"}, "guided_regex", "guided_regex cannot be compiled: "),
    ({"guided_json": "{bad json"}, "guided_json", "guided_json is not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one of"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "at most one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frob"}}}}}], "tool_choice": "required"},
     "tools", "tools[*].function.parameters cannot be compiled"),
    ({"tools": [{"type": "nope"}]}, "tools", "tools[0] must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"not": {}}}}},
     "response_format", "response_format.json_schema.schema uses 'not' at #, which the "
     "xgrammar grammar backend does not enforce"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {
        "type": "array", "uniqueItems": True}}}}},
     "structured_outputs", "uses 'uniqueItems' at #/properties/a"),
    ({"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "guided_json",
     "guided_json cannot be compiled: Unsatisfiable schema: incompatible types"),
    ({"guided_json": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}},
     "guided_json", "guided_json uses 'if/then/else' at #"),
    ({"guided_grammar": 'root ::= root "a"'}, "guided_grammar",
     "guided_grammar has no finite derivation: rule 'root' never ends"),
    ({"structured_outputs": {"grammar": 'root ::= "x" | b\nb ::= "y" b'}},
     "structured_outputs", "rule 'b' never ends"),
    ({"guided_json": DEEP_SCHEMA}, "guided_json", "guided_json nests deeper than 128 levels"),
]


@pytest.mark.parametrize("extra,param,message", BAD)
def test_bad_specs_are_400s_naming_the_field(server, extra, param, message):
    for stream in (False, True):
        r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ask("hi"), "max_tokens": 4, "stream": stream, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
    ok = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ask("hi"), "max_tokens": 2})
    assert ok.status_code == 200


def test_auto_without_parser_is_400(default_model_path):
    plain = [a for a in ARGS if a not in ("--enable-auto-tool-choice", "--tool-call-parser",
                                          "hermes")]
    with ServerProcess(plain) as srv:
        r = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ask("hi"), "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_llguidance_backend_serves_parse_tools_and_400s(default_model_path):
    with ServerProcess([*ARGS, "--structured-outputs-backend", "llguidance"]) as srv:
        c = srv.openai_client()
        for i in range(3):
            r = c.chat.completions.parse(
                model=MODEL, messages=ask(f"Invent person number {i} as JSON."),
                response_format=Person, temperature=0.7, seed=i, max_completion_tokens=300)
            assert isinstance(r.choices[0].message.parsed, Person), r.choices[0].message.content
        r = c.chat.completions.create(model=MODEL, messages=ask("Weather in Paris?"),
                                      tools=TOOLS, tool_choice="required", temperature=0,
                                      max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                SCHEMAS[call.function.name])
        bad = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ask("hi"), "max_tokens": 4, "guided_regex": "(open"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
        assert "guided_regex cannot be compiled: " in bad.json()["error"]["message"]
        for extra, message in [
                ({"guided_json": {"not": {"type": "string"}}},
                 "guided_json uses 'not' at #, which the llguidance grammar backend does not "
                 "enforce"),
                ({"guided_grammar": "root ::= a\na ::= a"},
                 "guided_grammar has no finite derivation: rule 'root' never ends")]:
            bad = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": ask("hi"), "max_tokens": 4, **extra})
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["message"].startswith(message), bad.json()
