"""A streamed ``echo`` with ``logprobs``: each choice opens with its prompt and the
prompt's logprobs, even when a sibling's tokens arrive before those logprobs are in
(they are held until then). The engine's scheduling makes that order rare, so the
engine side is a fake here."""

from __future__ import annotations

import json
import types

from pagedserve import CompletionOutput, TokenLogprobs
from pagedserve.server import completions
from pagedserve.server.generation import Prompt
from pagedserve.server.logprobs import TokenPiece
from pagedserve.server.options import ServeOptions
from tests.helpers.server import post_to_handler, run_in_process, sse_events


def _out(index: int, text: str, token: int | None, finish: str | None = None):
    lps = [] if token is None else [TokenLogprobs(token, -0.5, [], rank=1)]
    return CompletionOutput(index, text, [] if token is None else [token], None, lps, finish)


async def _updates(gen, n, tally):
    yield [(1, _out(1, " b", 11))]  # the sibling first: the prompt's logprobs are not in
    tally.prompt_logprobs[0] = [None, TokenLogprobs(8, -2.0, [], rank=3, text_offset=3)]
    yield [(0, _out(0, " a", 10)), (1, _out(1, "", None, "length"))]
    yield [(0, _out(0, "", None, "length"))]


def test_a_siblings_tokens_wait_for_the_prompts_echo(monkeypatch):
    monkeypatch.setattr(completions, "choice_updates", _updates)
    state = types.SimpleNamespace(
        options=ServeOptions(),
        token_piece=lambda t: TokenPiece(f"<{t}>", [t], 3))
    ctx = completions._Ctx(
        id="cmpl-1", created=0, model="m", n=2, prompts=[Prompt([7, 8], "<7><8>")],
        echo_texts=["<7><8>"], want_logprobs=True, want_prompt_logprobs=False,
        include_usage=False, pieces=state.token_piece)

    async def handler(request):
        return await completions._stream(request, state, None, ctx)

    events = sse_events(post_to_handler(state, handler))
    assert events[-1] == b"[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    for k in (0, 1):
        mine = [c for c in choices if c["index"] == k]
        assert [c["text"] for c in mine] == ["<7><8>", f" {'ab'[k]}", ""]
        assert mine[0]["logprobs"] == {"tokens": ["<7>", "<8>"], "token_logprobs": [None, -2.0],
                                       "top_logprobs": [None, {"<8>": -2.0}],
                                       "text_offset": [0, 3]}
        assert mine[1]["logprobs"]["text_offset"] == [6]  # after the echoed prompt
        assert mine[-1]["finish_reason"] == "length"


def test_offsets_index_the_echo_when_the_tokenizer_adds_a_bos(tmp_path, make_tiny,
                                                              default_model_path):  # fmt: skip
    """With logprobs the echo is the prompt's tokens decoded (here with the BOS the
    tokenizer adds), and every ``text_offset`` is where its token's text begins."""
    from pagedserve import EngineConfig
    from pagedserve.engine.loop.llm_engine import LLMEngine

    path = make_tiny("llama", tmp_path / "bos", default_model_path)
    tok_file = path / "tokenizer.json"
    spec = json.loads(tok_file.read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                            "tokens": ["<|im_start|>"]}}}
    tok_file.write_text(json.dumps(spec))
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32",
                                                kv_cache_memory_gb=0.02))
    prompt = "Hello world, how are you"

    async def script(client):
        r = await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True,
            "logprobs": 1, "ignore_eos": True})
        return await r.json()

    choice = run_in_process(engine, ServeOptions(), script)["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith("<|im_start|>" + prompt)
    assert lp["tokens"][0] == "<|im_start|>" and lp["token_logprobs"][0] is None
    assert len(lp["tokens"]) == len(engine.tokenizer.encode(prompt)) + 5
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert token.startswith("bytes:") or text[offset:].startswith(token), (token, offset)
