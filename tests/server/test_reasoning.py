"""``--reasoning-parser``: a reasoning model's thinking in ``reasoning_content``, its
answer in ``content`` (and its tool calls parsed from the answer alone), streamed or
whole; ``chat_template_kwargs`` reaching the chat template."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from pagedserve import CompletionOutput
from pagedserve.server import chat
from pagedserve.server.options import ServeOptions
from pagedserve.server.reasoning import ReasoningParser
from pagedserve.server.tools import ToolPlan
from tests.helpers.server import post_to_handler, run_in_process, sse_events

TEMPLATE = (Path(__file__).parent / "data" / "thinking_template.jinja").read_text()
OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"
"""A template that starts the output inside the reasoning (DeepSeek-R1)."""
QWEN3_ON = "<|im_start|>assistant\n"
QWEN3_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

CASES = [
    # (prompt, output, reasoning, content)
    (QWEN3_ON, "<think>\nLet me see.\n2+2 is 4.\n</think>\n\nIt is 4.", "Let me see.\n2+2 is 4.",
     "It is 4."),
    (QWEN3_ON, "  <think>a</think>b", "a", "b"),
    (QWEN3_ON, "No thinking here.", "", "No thinking here."),
    (QWEN3_ON, "  leading space kept", "", "  leading space kept"),
    (QWEN3_ON, "<thinking> is not the tag", "", "<thinking> is not the tag"),
    (QWEN3_ON, "<thi", "", "<thi"),
    (QWEN3_ON, "<think>\ncut short by the token limit  ", "cut short by the token limit", ""),
    (QWEN3_ON, "<think></think>", "", ""),
    (QWEN3_ON, "<think>x</think>y </think> z", "x", "y </think> z"),
    (QWEN3_OFF, "Direct answer.", "", "Direct answer."),
    (QWEN3_OFF, "<think>still may think</think>ok", "still may think", "ok"),
    (OPEN_PROMPT, "First, 1 < 2.\n</think>\nYes.", "First, 1 < 2.", "Yes."),
    (OPEN_PROMPT, "<think>repeated tag</think>Yes.", "repeated tag", "Yes."),
    (OPEN_PROMPT, "never closed", "never closed", ""),
    (OPEN_PROMPT, "a </th b </think>c", "a </th b", "c"),
    (OPEN_PROMPT + "x</think>", "plain", "", "plain"),
    # a tag in a message's text opens nothing: only the prompt's end counts
    ("<|im_start|>user\nWhat is <think> for?<|im_end|>\n" + QWEN3_ON, "A tag.", "", "A tag."),
]


def _split(prompt: str, pieces: list[str]) -> tuple[str, str]:
    p = ReasoningParser("qwen3", prompt)
    out = [p.feed(piece) for piece in pieces] + [p.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("prompt, output, reasoning, content", CASES)
def test_the_split_is_the_same_whole_and_in_every_two_or_one_character_pieces(
        prompt, output, reasoning, content):
    assert _split(prompt, [output]) == (reasoning, content)
    assert _split(prompt, list(output)) == (reasoning, content)
    for cut in range(len(output) + 1):
        assert _split(prompt, [output[:cut], output[cut:]]) == (reasoning, content), cut


def test_pieces_are_emitted_as_soon_as_they_cannot_be_a_tag():
    p = ReasoningParser("deepseek_r1", OPEN_PROMPT)
    assert p.feed("Think") == ("Think", "")
    assert p.feed(" more </") == (" more", "")  # the space and "</" may precede the tag
    assert p.feed("b> x") == (" </b> x", "")
    assert p.feed("</think>\n\nDo") == ("", "Do")
    assert p.feed(" it.") == ("", " it.")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("granite", "")


QWEN3_OUTPUT = ("<think>\nThe user wants Oslo's weather.\n</think>\n\n"
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                "</tool_call>")


def _serve_fake(ctx: chat._Ctx, pieces: list[str], stream: bool, monkeypatch) -> list | dict:
    """The chat route's stream or whole response for a choice that generates
    ``pieces``, one engine step each."""
    async def updates(gen, n, tally):
        for k, text in enumerate(pieces):
            last = k == len(pieces) - 1
            yield [(0, CompletionOutput(0, text, [k], None, [], "stop" if last else None))]

    monkeypatch.setattr(chat, "choice_updates", updates)
    state = types.SimpleNamespace(options=ServeOptions(), token_piece=None)

    async def handler(request):
        if stream:
            return await chat._stream(request, state, None, ctx)
        return await chat._whole(state, None, ctx)

    raw = post_to_handler(state, handler)
    if not stream:
        return json.loads(raw)
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    return [json.loads(e)["choices"][0] for e in events[:-1]]


def _ctx(prompt_text: str, tools: ToolPlan, include_reasoning: bool = True) -> chat._Ctx:
    return chat._Ctx(id="chatcmpl-1", created=0, model="m", n=1, prompt_tokens=3,
                     want_logprobs=False, want_prompt_logprobs=False, include_usage=False,
                     tools=tools, pieces=None, reasoning_parser="qwen3",
                     include_reasoning=include_reasoning, prompt_text=prompt_text)


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, len(QWEN3_OUTPUT)])
def test_thinking_then_a_tool_call_streamed_and_whole(size, monkeypatch):
    tools = ToolPlan(tools=[{"type": "function"}], parser="hermes")
    chunks = _serve_fake(_ctx(QWEN3_ON, tools), _pieces(QWEN3_OUTPUT, size), True, monkeypatch)
    deltas = [c["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    assert thought == "".join(d.get("reasoning", "") for d in deltas)
    assert thought == "The user wants Oslo's weather."
    assert "".join(d.get("content", "") for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Oslo"}
    assert [c["finish_reason"] for c in chunks][-1] == "tool_calls"
    # no delta after the first call carries reasoning
    first_answer = next(k for k, d in enumerate(deltas) if d.get("tool_calls"))
    assert not any("reasoning_content" in d for d in deltas[first_answer + 1:])

    body = _serve_fake(_ctx(QWEN3_ON, tools), _pieces(QWEN3_OUTPUT, size), False,
                       monkeypatch)
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == thought
    assert msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_include_reasoning_false_drops_the_thinking(monkeypatch):
    out = "<think>secret steps</think>\n\nThe answer."
    chunks = _serve_fake(_ctx(QWEN3_ON, ToolPlan(tools=None), include_reasoning=False),
                         _pieces(out, 4), True, monkeypatch)
    assert not any("reasoning_content" in c["delta"] for c in chunks)
    assert "".join(c["delta"].get("content", "") for c in chunks) == "The answer."
    body = _serve_fake(_ctx(QWEN3_ON, ToolPlan(tools=None), include_reasoning=False), [out],
                       False, monkeypatch)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "The answer."}


async def _post(client, path: str, body: dict):
    r = await client.post(path, json=body)
    raw = await r.read()
    return r.status, ([json.loads(e) for e in sse_events(raw)[:-1]] if body.get("stream")
                      else json.loads(raw))


def _with_real_server(default_model_path, script):
    """``script(client)`` against an in-process server of the default model with
    ``--reasoning-parser qwen3`` and a template that opens the thinking unless
    ``enable_thinking`` is false."""
    from pagedserve import EngineConfig
    from pagedserve.engine.loop.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(default_model_path), dtype="float32",
                                                kv_cache_memory_gb=0.05, max_model_len=1024))
    return run_in_process(
        engine, ServeOptions(reasoning_parser="qwen3", chat_template=TEMPLATE), script)


def test_a_real_model_thinks_and_chat_template_kwargs_turn_it_off(default_model_path):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
               *msgs]
    gen = {"max_tokens": 12, "temperature": 0,
           "ignore_eos": True}
    off = {"chat_template_kwargs": {"enable_thinking": False}}

    async def script(client):
        out = {}
        for name, ask in (("on", msgs), ("off", dict(messages=msgs, **off))):
            body = {"messages": ask} if name == "on" else ask
            status, tok = await _post(client, "/tokenize", body)
            assert status == 200
            # what the model writes after the rendered prompt, as a plain completion
            status, plain = await _post(client, "/v1/completions",
                                        {**gen, "prompt": tok["tokens"]})
            assert status == 200, plain
            out[name] = tok["tokens"], plain["choices"][0]["text"]
            out[name + " whole"] = await _post(client, "/v1/chat/completions",
                                               {**gen, **body})
        free = {"max_tokens": 12, "temperature": 0, "messages": msgs}
        choice = {**free, "structured_outputs": {"choice": ["Paris", "Lyon"]}}
        out["free"] = await _post(client, "/v1/chat/completions", free)
        out["choice"] = await _post(client, "/v1/chat/completions", choice)
        out["choice off"] = await _post(client, "/v1/chat/completions", {**choice, **off})
        out["streamed"] = await _post(client, "/v1/chat/completions",
                                      {**gen, "messages": msgs, "stream": True})
        status, tok = await _post(client, "/tokenize", {"messages": history})
        out["history"] = (await _post(client, "/detokenize", {"tokens": tok["tokens"]}))[1]
        out["bad"] = [await _post(client, "/v1/chat/completions",
                                  {**gen, "messages": msgs, "chat_template_kwargs": kw})
                      for kw in ({"tokenize": True}, [1])]
        return out

    out = _with_real_server(default_model_path, script)
    (on_ids, on_text), (off_ids, off_text) = out["on"], out["off"]
    assert len(off_ids) > len(on_ids)  # the empty <think></think> block
    assert on_text.strip() and "</think>" not in on_text

    status, whole = out["on whole"]
    assert status == 200
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == on_text.strip()
    assert msg["content"] is None
    usage = whole["usage"]  # every token was generated inside the reasoning
    assert usage["completion_tokens_details"] == {"reasoning_tokens": usage["completion_tokens"]}
    status, chunks = out["streamed"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == on_text.strip()
    assert all(d.get("content", "") == "" for d in deltas)
    status, whole = out["off whole"]
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": off_text}
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}

    # Structured outputs wait for the reasoning: the thinking is the model's own; with
    # thinking off the grammar applies from the first token.
    free, constrained = (out[k][1]["choices"][0]["message"] for k in ("free", "choice"))
    assert constrained == free and free["reasoning_content"]
    off_answer = out["choice off"][1]["choices"][0]["message"]
    assert off_answer["content"] in ("Paris", "Lyon") and "reasoning_content" not in off_answer

    assert "<think>\nGreet back.\n</think>\n\nHello!" in out["history"]["prompt"]
    for status, err in out["bad"]:
        assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err
    assert "tokenize" in out["bad"][0][1]["error"]["message"]


def test_a_named_call_waits_for_the_reasoning_to_end(monkeypatch):
    """With a named tool_choice the arguments follow the thinking: no call is announced
    while the model thinks, and its arguments are the text after </think>."""
    out = '<think>Oslo, in celsius.</think>{"city": "Oslo"}'
    tools = ToolPlan(tools=[{"type": "function"}], parser="named", function_name="get_weather")
    for size in (1, 4, len(out)):
        chunks = _serve_fake(_ctx(QWEN3_ON, tools), _pieces(out, size), True, monkeypatch)
        deltas = [c["delta"] for c in chunks]
        first_call = next(k for k, d in enumerate(deltas) if d.get("tool_calls"))
        thought = "".join(d.get("reasoning_content", "") for d in deltas)
        assert thought == "Oslo, in celsius."
        assert "".join(d.get("reasoning_content", "") for d in deltas[:first_call + 1]) == thought
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Oslo"}'
    cut = _serve_fake(_ctx(QWEN3_ON, tools), ["<think>still thinking"], False, monkeypatch)
    msg = cut["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["reasoning_content"] == "still thinking"
