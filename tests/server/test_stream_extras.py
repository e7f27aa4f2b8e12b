"""vLLM's request extras on the OpenAI routes: ``stream_options.continuous_usage_stats``
(every chunk carries the usage so far), ``truncate_prompt_tokens`` (a prompt cut to
its last k tokens: the same output as sending those k tokens) and ``cache_salt`` (cached
prefixes shared only among requests of one salt)."""

from __future__ import annotations

import json

import pytest

from pagedserve import EngineConfig
from pagedserve.engine.loop.llm_engine import LLMEngine
from pagedserve.server.options import ServeOptions
from tests.helpers.server import run_in_process, sse_events

MAX_LEN = 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path, make_tiny):
    path = make_tiny("llama", tmp_path_factory.mktemp("extras"), default_model_path)
    return LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32",
                                              kv_cache_memory_gb=0.02, max_model_len=MAX_LEN))


def _serve(engine, script):
    return run_in_process(engine, ServeOptions(), script)


async def _post(client, path, body):
    r = await client.post(path, json=body)
    raw = await r.read()
    if body.get("stream") and r.status == 200:
        return r.status, [json.loads(e) for e in sse_events(raw)[:-1]]
    return r.status, json.loads(raw)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(engine, route):
    ask = ({"prompt": [5, 6, 7, 8]} if route == "/v1/completions"
           else {"messages": [{"role": "user", "content": "hi"}]})
    body = {**ask, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}

    async def script(client):
        return [await _post(client, route, {**body, "stream_options": opts}) for opts in (
            {"include_usage": True, "continuous_usage_stats": True},
            {"include_usage": True})]

    (s1, chunks), (s2, plain) = _serve(engine, script)
    assert s1 == s2 == 200
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    prompt = usages[-1]["prompt_tokens"]
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 6 and usages[-1]["total_tokens"] == prompt + 6
    assert all(u["prompt_tokens"] == prompt for u in usages)
    if route.endswith("chat/completions"):
        assert done[0] == 0  # the role chunk, before any token
    else:
        assert done[0] >= 1
    # without the flag only the last (usage-only) chunk has usage
    assert [c["usage"] is None for c in plain] == [True] * (len(plain) - 1) + [False]


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    ids = list(range(100, 160))
    gen = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def script(client):
        out = {"cut": await _post(client, "/v1/completions", {
            "prompt": ids, "truncate_prompt_tokens": 12, "echo": True, **gen}),
            "tail": await _post(client, "/v1/completions", {"prompt": ids[-12:], **gen}),
            "short": await _post(client, "/v1/completions", {
                "prompt": ids[:5], "truncate_prompt_tokens": 12, **gen}),
            "chat": await _post(client, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hello " * 40}],
                "truncate_prompt_tokens": 20, **gen}),
            "responses": await _post(client, "/v1/responses", {
                "input": "hello " * 40, "truncate_prompt_tokens": 20, "max_output_tokens": 3,
                "temperature": 0}),
            "whole": await _post(client, "/v1/completions", {
                "prompt": ids, "truncate_prompt_tokens": -1, **gen})}
        out["bad"] = [await _post(client, "/v1/completions", {
            "prompt": ids, "truncate_prompt_tokens": k, **gen}) for k in (0, -2, MAX_LEN + 1)]
        out["detok"] = await _post(client, "/detokenize", {"tokens": ids[-12:]})
        return out

    out = _serve(engine, script)
    (s, cut), (_, tail) = out["cut"], out["tail"]
    assert s == 200 and cut["usage"]["prompt_tokens"] == 12
    text = cut["choices"][0]["text"]
    assert text == out["detok"][1]["prompt"] + tail["choices"][0]["text"]  # echo: the cut
    assert out["short"][1]["usage"]["prompt_tokens"] == 5  # shorter prompts are untouched
    assert out["chat"][1]["usage"]["prompt_tokens"] == 20
    assert out["responses"][1]["usage"]["input_tokens"] == 20
    assert out["whole"][1]["usage"]["prompt_tokens"] == 60
    for status, err in out["bad"]:
        assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens", err


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_cache_salt_shares_cached_prefixes_only_within_a_salt(engine, route):
    # A system message of its own: no route's first block is another's.
    words = " ".join([route.rsplit("/", 1)[1]] * 60)
    ask = {"/v1/completions": {"prompt": list(range(300, 360)), "max_tokens": 2},
           "/v1/chat/completions": {"messages": [{"role": "system", "content": words},
                                                 {"role": "user", "content": "hi"}],
                                    "max_tokens": 2},
           "/v1/responses": {"instructions": words, "input": "hi",
                             "max_output_tokens": 2}}[route]
    salts = [None, None, "tenant-a", "tenant-a", "tenant-b", None]

    async def script(client):
        out = []
        for salt in salts:
            body = {**ask, "temperature": 0} | ({} if salt is None else {"cache_salt": salt})
            out.append(await _post(client, route, body))
        out.append(await _post(client, route, {**ask, "cache_salt": ""}))
        return out

    *answers, (bad_status, bad) = _serve(engine, script)
    assert [status for status, _ in answers] == [200] * len(salts)
    usage = [a["usage"] for _, a in answers]
    details = "input_tokens_details" if route == "/v1/responses" else "prompt_tokens_details"
    cached = [u[details]["cached_tokens"] for u in usage]
    # Whole blocks of the prompt are cached after the first request of each salt; a salt
    # never sees another's blocks (nor the unsalted ones).
    whole = cached[1]
    assert whole > 0 and whole % 16 == 0
    assert cached == [0, whole, 0, whole, 0, whole], cached
    assert bad_status == 400
    assert bad["error"]["param"] == "cache_salt" and "non-empty" in bad["error"]["message"]


def _held_stop(text: str, toks: list[str]) -> str:
    """A stop string made of a token's whole text and the next one's first character,
    first found where that token begins (so the token's text is held back, then cut), for
    some token after the second; the test cannot run on an output without one."""
    start = 0
    for j, tok in enumerate(toks[:-2]):  # the cut leaves a token or more unmade
        stop = tok + toks[j + 1][:1]
        if j >= 2 and tok and toks[j + 1] and text.find(stop) == start:
            return stop
        start += len(tok)
    pytest.fail(f"no token of {toks!r} begins a stop string at its own place")


def _stream_ids(chunks: list[dict], choice: int = 0) -> list[int]:
    return [t for c in chunks for ch in c["choices"] if ch["index"] == choice
            for t in ch.get("token_ids", [])]


def test_return_token_ids_on_completions(engine):
    """vLLM's ``return_token_ids``: each choice carries its prompt's ids and the ids it
    generated (streamed: the prompt ids in its first chunk, the new ids in every chunk,
    ids whose text a possible stop string held back included); with
    ``return_tokens_as_token_ids`` logprobs name tokens ``token_id:N``."""
    gen = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}

    async def script(client):
        plain = await _post(client, "/v1/completions", {"prompt": [5, 6, 7, 8], **gen})
        text = plain[1]["choices"][0]["text"]
        stop = _held_stop(text, plain[1]["choices"][0]["logprobs"]["tokens"])
        body = {"prompt": [[5, 6, 7, 8], [9, 10]], "n": 2, "return_token_ids": True,
                "return_tokens_as_token_ids": True, **gen}
        runs = [await _post(client, "/v1/completions", {**body, "stream": s}) for s in (False, True)]
        stopped = [await _post(client, "/v1/completions", {
            "prompt": [5, 6, 7, 8], "stop": [stop], "return_token_ids": True, "stream": s,
            **gen}) for s in (False, True)]
        echo = await _post(client, "/v1/completions", {
            "prompt": [5, 6, 7, 8], "echo": True, "stream": True, "return_token_ids": True,
            **gen})
        return plain, text, stop, runs, stopped, echo

    plain, text, stop, ((s1, whole), (s2, chunks)), stopped, (s3, echo) = _serve(engine, script)
    assert plain[0] == s1 == s2 == s3 == 200, whole
    assert "token_ids" not in plain[1]["choices"][0]
    assert "prompt_token_ids" not in plain[1]["choices"][0]
    for k, choice in enumerate(whole["choices"]):
        assert choice["prompt_token_ids"] == [[5, 6, 7, 8], [9, 10]][k // 2]
        ids = choice["token_ids"]
        assert len(ids) == 8
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
        assert all(set(top) >= {f"token_id:{t}"}
                   for top, t in zip(choice["logprobs"]["top_logprobs"], ids, strict=True))
        assert _stream_ids(chunks, k) == ids  # greedy: the stream's ids are the same
        firsts = [ch for c in chunks for ch in c["choices"] if ch["index"] == k]
        assert firsts[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in ch for ch in firsts[1:])
    assert whole["choices"][0]["text"] == text
    (_, cut), (_, cut_chunks) = stopped
    cut_ids = cut["choices"][0]["token_ids"]
    assert cut["choices"][0]["finish_reason"] == "stop" and 3 <= len(cut_ids) < 8
    assert cut_ids == whole["choices"][0]["token_ids"][:len(cut_ids)]
    assert _stream_ids(cut_chunks) == cut_ids
    assert any(not ch["choices"][0]["text"] and ch["choices"][0]["finish_reason"] for ch in
               cut_chunks)  # the held text never went out
    first = echo[0]["choices"][0]  # the echoed prompt's chunk carries the prompt ids
    assert first["prompt_token_ids"] == [5, 6, 7, 8] and first["token_ids"] == []
    assert _stream_ids(echo) == whole["choices"][0]["token_ids"]


def test_return_token_ids_on_chat(engine):
    messages = [{"role": "user", "content": "Say something about the weather."}]
    gen = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def script(client):
        r = await client.post("/tokenize", json={"messages": messages})
        prompt = (await r.json())["tokens"]
        out = [await _post(client, "/v1/chat/completions", {
            **gen, "stream": s, "return_token_ids": True, "logprobs": True,
            "top_logprobs": 2, "return_tokens_as_token_ids": True}) for s in (False, True)]
        plain = await _post(client, "/v1/chat/completions", {**gen, "logprobs": True})
        choice = plain[1]["choices"][0]
        stop = _held_stop(choice["message"]["content"],
                          [e["token"] for e in choice["logprobs"]["content"]])
        stopped = [await _post(client, "/v1/chat/completions", {
            **gen, "stop": stop, "stream": s, "return_token_ids": True}) for s in (False, True)]
        return prompt, out, plain, stopped

    prompt, ((s1, whole), (s2, chunks)), (s3, plain), stopped = _serve(engine, script)
    assert s1 == s2 == s3 == 200
    assert whole["prompt_token_ids"] == prompt == chunks[0]["prompt_token_ids"]
    assert whole["usage"]["prompt_tokens"] == len(prompt)
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == 6 and _stream_ids(chunks) == ids
    content = whole["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    assert whole["choices"][0]["message"] == plain["choices"][0]["message"]
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    (_, cut), (_, cut_chunks) = stopped
    cut_ids = cut["choices"][0]["token_ids"]
    assert cut["choices"][0]["finish_reason"] == "stop" and 3 <= len(cut_ids) < 6
    assert cut_ids == ids[:len(cut_ids)] and _stream_ids(cut_chunks) == cut_ids
