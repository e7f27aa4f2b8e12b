"""``/v1/responses`` through the real ``openai`` SDK (its stream helper checks the
events' order and indexes as it assembles them): the same text as chat completions,
function calls and their round trip, ``text.format``, reasoning items, exact SSE
framing, and 400s naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

from tests.helpers.server import ServerProcess

DATA = Path(__file__).parent / "data"
ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25", "--max-model-len",
        "2048", "--dtype", "float32", "--log-level", "warning"]
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}
GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def server(default_model_path):
    args = [*ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--chat-template", str(DATA / "tools_template.jinja")]
    with ServerProcess(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def _streamed(client, **kw):
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        # A cut response ends with response.incomplete, which carries it (the helper's
        # get_final_response() waits for response.completed).
        final = events[-1].response if events[-1].type == "response.incomplete" else \
            stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, final


@pytest.mark.parametrize("limit", [4, 200])
def test_text_equals_chat_whole_and_streamed(client, limit):
    instructions, question = "Answer briefly.", "What is 2+2?"
    chat = client.chat.completions.create(
        messages=[{"role": "system", "content": instructions},
                  {"role": "user", "content": question}],
        max_completion_tokens=limit, **GREEDY)
    r = client.responses.create(instructions=instructions, input=question,
                                max_output_tokens=limit, **GREEDY)
    text = chat.choices[0].message.content
    assert r.output_text == text and text
    cut = chat.choices[0].finish_reason == "length"
    assert cut == (limit == 4)
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details and r.incomplete_details.reason) == (
        "max_output_tokens" if cut else None)
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].status == r.status
    u, cu = r.usage, chat.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        cu.prompt_tokens, cu.completion_tokens, cu.total_tokens)
    assert u.output_tokens_details.reasoning_tokens == 0

    events, final = _streamed(client, instructions=instructions, input=question,
                              max_output_tokens=limit, **GREEDY)
    assert final.output_text == text and final.status == r.status
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == text
    assert events[-1].type == ("response.incomplete" if cut else "response.completed")


def test_logprobs_equal_chat_whole_and_streamed(client):
    """include=["message.output_text.logprobs"] with top_logprobs: the message's tokens'
    logprobs as chat completions gives them; streamed, each delta carries its tokens'."""
    ask = {"instructions": "Answer briefly.", "input": "Name a color.",
           "max_output_tokens": 12, **GREEDY}
    chat = client.chat.completions.create(
        messages=[{"role": "system", "content": ask["instructions"]},
                  {"role": "user", "content": ask["input"]}],
        max_completion_tokens=12, logprobs=True, top_logprobs=3, **GREEDY)
    want = [c.model_dump() for c in chat.choices[0].logprobs.content]
    assert len(want) == chat.usage.completion_tokens and len(want[0]["top_logprobs"]) == 3
    # Chat lists the end-of-turn token too; the message's text has no such token.
    assert chat.choices[0].finish_reason == "stop" and want[-1]["token"] == "<|im_end|>"
    want = want[:-1]
    r = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=3, **ask)
    part = r.output[0].content[0]
    assert part.text == chat.choices[0].message.content and r.top_logprobs == 3
    assert [lp.model_dump() for lp in part.logprobs] == want
    events, final = _streamed(client, include=["message.output_text.logprobs"],
                              top_logprobs=3, **ask)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.model_dump() for e in deltas for lp in e.logprobs] == want
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.model_dump() for lp in done.logprobs] == want
    assert [lp.model_dump() for lp in final.output[0].content[0].logprobs] == want
    # Without them asked for: empty lists; an unknown include is ignored; top_logprobs
    # without the include gives none either (as OpenAI's API).
    plain = client.responses.create(include=["reasoning.encrypted_content"], **ask)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text
    alone = client.responses.create(top_logprobs=3, **ask)
    assert alone.output[0].content[0].logprobs == [] and alone.output_text == part.text


def test_sse_framing_is_event_then_data(server):
    r = requests.post(server.url + "/v1/responses", json={
        "input": "Hi", "max_output_tokens": 3, "stream": True, **GREEDY}, timeout=60)
    assert r.headers["Content-Type"] == "text/event-stream"
    raw = r.content.decode()
    assert raw.endswith("\n\n")
    for k, block in enumerate(raw[:-2].split("\n\n")):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[len("data: "):])
        assert obj["type"] == head[len("event: "):] and obj["sequence_number"] == k


def test_function_calls_validate_and_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(input=ask, tools=[WEATHER], tool_choice="required",
                                max_output_tokens=100, **GREEDY)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    for c in calls:
        assert c.name == "get_weather" and c.call_id.startswith("call_")
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    events, final = _streamed(client, input=ask, tools=[WEATHER], tool_choice="required",
                              max_output_tokens=100, **GREEDY)
    assert [(o.name, o.arguments) for o in final.output] == [(c.name, c.arguments)
                                                              for c in calls]
    assert any(e.type == "response.function_call_arguments.delta" for e in events)

    named = client.responses.create(input=ask, tools=[WEATHER], max_output_tokens=100,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    **GREEDY)
    assert [o.type for o in named.output] == ["function_call"]
    # The second turn: the call and its result go back as input items.
    follow = [*ask, *[o.model_dump(exclude_none=True) for o in r.output],
              *[{"type": "function_call_output", "call_id": c.call_id,
                 "output": json.dumps({"temperature": 21})} for c in calls]]
    second = client.responses.create(input=follow, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=20, **GREEDY)
    assert second.output_text and second.usage.input_tokens > r.usage.input_tokens


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(
        input="Invent a person.", max_output_tokens=80, **GREEDY,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"n": 2}, "n"),
    ({"tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": [{"type": "reasoning", "content": 5}]}, "input"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": "[" * 5000 + "]" * 5000}}}, "text"),
    ({"input": [{"role": "user", "content": "hi", "id": ["msg_1"]}]}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(server, extra, param):
    body = {"model": MODEL, "input": "Hi", **extra}
    r = requests.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("item_id, kind", [(["msg_1"], "an array"), ({"a": 1}, "an object")])
def test_an_item_id_that_is_no_string_is_400_whole_and_streamed(server, item_id, kind):
    for stream in (False, True):
        r = requests.post(server.url + "/v1/responses", timeout=60, json={
            "model": MODEL, "max_output_tokens": 2, "stream": stream, "input": [
                {"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
                 "id": item_id}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": f"input[1].id must be a string, got {kind}",
                                     "type": "BadRequestError", "param": "input", "code": 400}
    assert requests.post(server.url + "/v1/responses", json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 2}, timeout=60).status_code == 200


def test_stored_responses_continue_a_conversation(client):
    """``previous_response_id``: the stored conversation (its input and output items,
    not its instructions) comes before the new input, whole or streamed; the same as
    sending the whole conversation."""
    first = client.responses.create(instructions="Answer in one word.", max_output_tokens=8,
                                    input="My name is Ada. Say hello.", **GREEDY)
    assert first.store and first.previous_response_id is None
    items = [{"role": "user", "content": "My name is Ada. Say hello."},
             *[o.model_dump(exclude_none=True) for o in first.output]]
    second = client.responses.create(previous_response_id=first.id, max_output_tokens=8,
                                     input="What is my name?", **GREEDY)
    items.append({"role": "user", "content": "What is my name?"})
    whole = client.responses.create(input=items, max_output_tokens=8, store=False, **GREEDY)
    assert second.previous_response_id == first.id
    assert (second.output_text, second.usage.input_tokens) == (
        whole.output_text, whole.usage.input_tokens)
    _, third = _streamed(client, previous_response_id=second.id, input="Thanks.",
                         max_output_tokens=8, **GREEDY)
    items += [*[o.model_dump(exclude_none=True) for o in second.output],
              {"role": "user", "content": "Thanks."}]
    whole = client.responses.create(input=items, max_output_tokens=8, store=False, **GREEDY)
    assert (third.output_text, third.usage.input_tokens) == (
        whole.output_text, whole.usage.input_tokens)
    assert client.responses.retrieve(third.id).model_dump() == third.model_dump()
    listed = list(client.responses.input_items.list(third.id, order="asc", limit=2))
    assert len(listed) == len(items) and len({x.id for x in listed}) == len(items)
    texts = [p.text for x in listed if x.type == "message" for p in x.content]
    assert texts[0] == "My name is Ada. Say hello." and texts[-1] == "Thanks."
    newest = client.responses.input_items.list(third.id, limit=1)
    assert newest.data[0].content[0].text == "Thanks." and newest.has_more
    before = client.responses.input_items.list(third.id, order="asc", limit=2,
                                               extra_query={"before": listed[-1].id})
    assert [x.id for x in before.data] == [x.id for x in listed[-3:-1]] and before.has_more
    assert client.responses.retrieve(first.id).output_text == first.output_text

    assert not whole.store  # store=False: kept nowhere
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(previous_response_id=whole.id, input="Hi", **GREEDY)
    assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_a_tool_loop_continues_a_stored_response(client):
    """The agent loop of OpenAI's examples: a response with a call, then only the call's
    output with ``previous_response_id``; the same as sending the whole conversation."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(input=ask, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=100, **GREEDY)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls
    results = [{"type": "function_call_output", "call_id": c.call_id,
                "output": json.dumps({"temperature": 21})} for c in calls]
    second = client.responses.create(previous_response_id=first.id, input=results,
                                     tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=20, **GREEDY)
    whole = client.responses.create(
        input=[*ask, *[o.model_dump(exclude_none=True) for o in first.output], *results],
        tools=[WEATHER], tool_choice="none", max_output_tokens=20, store=False, **GREEDY)
    assert second.output_text and (second.output_text, second.usage.input_tokens) == (
        whole.output_text, whole.usage.input_tokens)


def test_truncation_auto_drops_the_oldest_turns(client, server):
    long = "word " * 1200
    items = [{"role": "user", "content": "First: " + long},
             {"role": "assistant", "content": "Noted."},
             {"role": "user", "content": "Second: " + long},
             {"role": "assistant", "content": "Noted again."},
             {"role": "user", "content": "What came second?"}]
    r = requests.post(server.url + "/v1/responses", timeout=60, json={
        "input": items, "max_output_tokens": 8, **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    cut = client.responses.create(input=items, max_output_tokens=8, truncation="auto",
                                  **GREEDY)
    assert cut.truncation == "auto"
    # The first turn goes (the user message and the answer after it), whole.
    kept = client.responses.create(input=items[2:], max_output_tokens=8, **GREEDY)
    assert (cut.output_text, cut.usage.input_tokens) == (kept.output_text,
                                                         kept.usage.input_tokens)
    # A stored conversation goes on past the context, continued with truncation.
    later = client.responses.create(previous_response_id=cut.id, input="And first?",
                                    max_output_tokens=8, truncation="auto", **GREEDY)
    assert later.status == "completed"
    assert cut.usage.input_tokens < later.usage.input_tokens <= 2048 - 8
    bad = requests.post(server.url + "/v1/responses", timeout=60, json={
        "input": "Hi", "truncation": "middle", **GREEDY})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation"


def test_the_store_is_bounded_and_can_be_off(tiny_model_factory):
    from pagedserve import EngineConfig
    from pagedserve.engine.loop.llm_engine import LLMEngine
    from pagedserve.server.options import ServeOptions
    from pagedserve.server.responses_store import ResponseStore
    from tests.helpers.server import run_in_process

    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [])
    assert len(store) == 2 and store.get("resp_2").response == {"id": "resp_2"}
    with pytest.raises(Exception, match="resp_0"):
        store.get("resp_0")

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_model_factory("llama")),
                                                dtype="float32", kv_cache_memory_gb=0.02))

    async def script(client):
        r = await client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
        first = await r.json()
        r = await client.post("/v1/responses", json={
            "input": "Hi", "max_output_tokens": 2, "previous_response_id": first["id"]})
        return first, r.status, await r.json()

    first, status, err = run_in_process(engine, ServeOptions(max_stored_responses=0), script)
    assert first["store"] is False and status == 400
    assert err["error"]["param"] == "previous_response_id"
    assert "--max-stored-responses 0" in err["error"]["message"]


def test_reasoning_items_with_a_reasoning_parser(default_model_path):
    """A template that opens the thinking: the output is a reasoning item whose text is
    chat's reasoning_content, and every output token counts as a reasoning token."""
    args = [*ARGS, "--reasoning-parser", "qwen3",
            "--chat-template", str(DATA / "thinking_template.jinja")]
    with ServerProcess(args) as srv:
        c = srv.openai_client()
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        chat = c.chat.completions.create(messages=ask, max_completion_tokens=10, **GREEDY)
        thought = chat.choices[0].message.model_extra["reasoning_content"]
        r = c.responses.create(input=ask, max_output_tokens=10, **GREEDY)
        events, final = _streamed(c, input=ask, max_output_tokens=10, **GREEDY)
    assert thought
    for resp in (r, final):
        assert [o.type for o in resp.output] == ["reasoning"]
        assert resp.output[0].content[0].text == thought and resp.output_text == ""
        u = resp.usage
        assert u.output_tokens_details.reasoning_tokens == u.output_tokens == chat.usage.completion_tokens
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought


def test_parallel_tool_calls_false_allows_one_required_call(client):
    import json as _json

    from pagedserve.server.options import ServeOptions
    from pagedserve.server.protocol import ChatCompletionRequest
    from pagedserve.server.tools import tool_plan

    chat_tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name",
                                                                           "parameters")}}
    for parallel, most in ((None, None), (False, 1)):
        plan = tool_plan(ChatCompletionRequest(tools=[chat_tool], tool_choice="required",
                                               parallel_tool_calls=parallel), ServeOptions())
        assert _json.loads(plan.constraint.spec.json).get("maxItems") == most
    r = client.responses.create(input="Weather in Paris, London and Rome?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=120, **GREEDY)
    assert [o.type for o in r.output] == ["function_call"] and r.parallel_tool_calls is False
