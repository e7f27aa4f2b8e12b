"""``/v1/responses``' output assembled step by step (``pagedserve.server.responses._Output``): which
tokens' logprobs the message carries, a call's arguments complete before the text after
it; and a stream cut by the request deadline ends with ``response.failed``."""

from __future__ import annotations

import json


def test_message_logprobs_are_the_message_tokens():
    """The message's logprobs: not those of the reasoning (nor of the steps that end
    it), nor end-of-turn tokens; held text's tokens join the text they become."""
    from types import SimpleNamespace as NS

    from pagedserve.server.chat import ChoiceParser
    from pagedserve.server.logprobs import TokenPiece
    from pagedserve.server.reasoning import ReasoningParser
    from pagedserve.server.responses import _Output

    vocab = ["<think>", "\n", "Hmm", "</think>", "\n\n", "Red", ".", "<eos>"]

    def run(steps, reasoning=True, prompt=""):
        out = _Output(base={}, input_tokens=0, streaming=False, special=frozenset({7}),
                      pieces=lambda t: TokenPiece(vocab[t], list(vocab[t].encode()),
                                                  len(vocab[t])),
                      parser=ChoiceParser(ReasoningParser("qwen3", prompt) if reasoning
                                          else None, None))  # fmt: skip
        for k, step in enumerate(steps):
            entries = [NS(token_id=t, logprob=-1.0 - t, top=[]) for t in step]
            out._feed("".join(vocab[t] for t in step if t != 7), len(step),
                      "stop" if k == len(steps) - 1 else None, entries)
        out._close()
        return {it.kind: (it.text, [lp["token"] for lp in it.logprobs]) for it in out.items}

    one_by_one = run([[0], [1], [2], [1], [3], [4], [5], [6], [7]])
    assert one_by_one["message"] == ("Red.", ["Red", "."])
    assert run([[5], [6], [7]], reasoning=False)["message"] == ("Red.", ["Red", "."])
    assert run([[5], [6, 7]], reasoning=False)["message"] == ("Red.", ["Red", "."])
    # Several tokens in a step: the last ones whose text covers the message's.
    assert run([[0, 2, 3, 5], [6]])["message"] == ("Red.", ["Red", "."])
    # A step that began inside the reasoning counts as reasoning (as reasoning_tokens
    # does): none of its tokens.
    opened = run([[2], [3, 5], [6]], prompt="<think>\n")
    assert opened["reasoning"][0] == "Hmm" and opened["message"] == ("Red.", ["."])


def _events(frames: bytes) -> list[dict]:
    return [json.loads(block.split("\ndata: ", 1)[1])
            for block in frames.decode().split("\n\n") if block]


def test_a_calls_last_arguments_come_before_the_text_that_follows_it():
    """One step may end a call and start text after it: the call's arguments are
    complete when its item is done, and nothing is added to it afterwards."""
    from pagedserve.server.chat import ChoiceParser
    from pagedserve.server.responses import _Output
    from pagedserve.server.tool_parser import ToolCallParser

    out = _Output(base={}, input_tokens=1,
                  parser=ChoiceParser(None, ToolCallParser("hermes")))
    steps = ['Sure.<tool_call>\n{"name": "f", "arguments": {"a": ', '1}}\n</tool_call>\nafter']
    frames = b"".join(b"".join(out._feed(t, 1, None)) for t in steps)
    frames += b"".join(out._feed("", 0, "stop")) + out._close()
    events = _events(frames)
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == '{"a": 1}'
    item_id = done["item_id"]
    after = events[events.index(done):]
    assert not any(e.get("item_id") == item_id and e["type"].endswith(".delta") for e in after)
    args = "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta")
    assert args == '{"a": 1}'
    assert [i.kind for i in out.items] == ["message", "function_call", "message"]
    assert [i.status for i in out.items] == ["completed"] * 3


def test_a_deadline_mid_stream_ends_with_response_failed(default_model_path):
    """Past --request-timeout the stream ends with a response.failed event (the
    Responses API's own error frame, not chat's), and the request is aborted."""
    from pagedserve import EngineConfig
    from pagedserve.engine.loop.llm_engine import LLMEngine
    from pagedserve.server.options import ServeOptions
    from tests.helpers.server import run_in_process

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(default_model_path), dtype="float32",
                                                kv_cache_memory_gb=0.05, max_model_len=1024))

    async def script(client):
        r = await client.post("/v1/responses", json={
            "input": "Count to a thousand.", "max_output_tokens": 900, "ignore_eos": True,
            "stream": True, "temperature": 0})
        return await r.read()

    raw = run_in_process(engine, ServeOptions(request_timeout=1.0), script)
    events = _events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert "--request-timeout" in last["response"]["error"]["message"]
    assert any(e["type"] == "response.output_text.delta" for e in events)
    assert engine.scheduler.kv.stats().num_used_blocks == 0
