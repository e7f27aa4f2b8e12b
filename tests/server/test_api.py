"""The real server (subprocess, default model) through the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import requests

from tests.helpers.hf import PROMPT_LOGPROB_TOL, hf_prompt_logprobs
from tests.helpers.server import ServerProcess, sse_events
from tests.helpers.server_checks import chat_prompt_len, chat_stream_equals_whole

SERVER_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
               "--max-model-len", "2048", "--dtype", "float32", "--log-level", "warning"]
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0)


def test_models_list_and_retrieve(client):
    (card,) = client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct" and card.object == "model"
    got = client.models.retrieve("SmolLM2-135M-Instruct")
    assert got.model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/no-such-model")
    assert err.value.body["param"] == "model" and "org/no-such-model" in err.value.body["message"]


def test_chat_stream_equals_whole(client, default_tokenizer):
    chat_stream_equals_whole(client, default_tokenizer, CHAT)


def test_completion_stream_equals_whole(client, default_tokenizer):
    whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                      max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.usage.prompt_tokens == len(default_tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == 12
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_completion_default_max_tokens_and_prompt_lists(client):
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[PROMPT, "Hi"],
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens <= 32
    assert all(c.finish_reason in ("length", "stop") for c in out.choices)
    ids = requests.post(client.base_url.join("/tokenize").__str__(),
                        json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[ids, ids[:3]],
                                       max_tokens=4, temperature=0, n=2)
    assert [c.index for c in by_ids.choices] == [0, 1, 2, 3]
    assert by_ids.usage.prompt_tokens == len(ids) + 3


def test_stop_string_never_leaks(client):
    free = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=24, temperature=0).choices[0].text
    words = free.split()
    stop = next(w for w in words[2:] if len(w) >= 3)
    expected = free[:free.index(stop)]
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == expected
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                         max_tokens=24, temperature=0, stop=stop, stream=True)
    text = "".join(c.choices[0].text for c in streamed)
    assert text == expected and stop not in text


COUNT = "1, 2, 3, 4,"  # the default model continues " 5, 6, 7, 8, 9, ..." greedily


@pytest.mark.parametrize("stop", ["7, 8", "5, 7"])  # a stop string hit, and one held back
def test_logprobs_go_out_with_their_text_and_never_for_a_stop_string(client, stop):
    """Logprobs are the tokens of the text the client gets: a chunk whose text is held
    back (it may start a stop string) holds back their logprobs too, and a stop string's
    tokens have none."""
    kw = dict(model="SmolLM2-135M-Instruct", prompt=COUNT, max_tokens=12, temperature=0,
              stop=stop, logprobs=0)
    whole = client.completions.create(**kw).choices[0]
    assert "".join(whole.logprobs.tokens) == whole.text  # these tokens decode one by one
    streamed = ""
    for chunk in client.completions.create(**kw, stream=True):
        (c,) = chunk.choices
        tokens = c.logprobs.tokens if c.logprobs is not None else []
        assert "".join(tokens) == c.text, chunk
        streamed += c.text
    assert streamed == whole.text
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=60, temperature=0, stop="11, 12",
        logprobs=True, messages=[{"role": "user", "content": "Count from 1 to 20 separated "
                                  "by commas, like 1, 2, 3"}])  # fmt: skip
    assert chat.choices[0].finish_reason == "stop"
    content = chat.choices[0].message.content
    assert "".join(t.token for t in chat.choices[0].logprobs.content) == content


def test_include_stop_str_and_logit_bias(client, default_tokenizer):
    free = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=24, temperature=0).choices[0].text
    stop = next(w for w in free.split()[2:] if len(w) >= 3)
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == free[:free.index(stop) + len(stop)]
    (tid,) = default_tokenizer.encode(" banana", add_special_tokens=False)[:1]
    biased = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=3, temperature=0, logprobs=0,
                                       logit_bias={str(tid): 100})
    assert biased.choices[0].logprobs.tokens == [default_tokenizer.decode([tid])] * 3


def test_n2_stream_carries_indexes(client):
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                            max_tokens=8, temperature=0.8, seed=7, n=2,
                                            stream=True)
    firsts: dict[int, object] = {}
    finishes: dict[int, int] = {0: 0, 1: 0}
    for chunk in stream:
        (choice,) = chunk.choices
        firsts.setdefault(choice.index, choice.delta)
        if choice.finish_reason is not None:
            finishes[choice.index] += 1
    assert set(firsts) == {0, 1}
    assert all(d.role == "assistant" and d.content == "" for d in firsts.values())
    assert finishes == {0: 1, 1: 1}


def test_same_seed_same_text(client):
    kw = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=12, temperature=1.0,
              seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                         max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for item in content:
        assert isinstance(item.token, str) and item.logprob <= 0
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
    assert content[0].token == content[0].top_logprobs[0].token  # greedy picks the top one


def test_completion_logprobs_shape(client):
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                         max_tokens=5, temperature=0, logprobs=2, stream=True)
    offsets = [o for c in streamed if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_completion_text_offsets_index_the_text_past_split_characters(client):
    """``text_offset`` is where each token's text begins in the text: a character split
    over several tokens (CJK here) takes one place in the text, not one per token."""
    kw = dict(model="SmolLM2-135M-Instruct", prompt="Chinese numbers: 一, 二, 三, 四,",
              max_tokens=12, temperature=0, logprobs=0)
    out = client.completions.create(**kw).choices[0]
    text, lp = out.text, out.logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens)  # some tokens split a character
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    clean = [(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True)
             if not t.startswith("bytes:")]
    assert clean and all(text[o:o + len(t)] == t for t, o in clean), (text, lp)
    streamed = [o for c in client.completions.create(**kw, stream=True)
                if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.text_offset


def test_logprobs_of_part_of_a_character(client, default_tokenizer):
    """A token holding only some bytes of a character: logprobs give its own bytes (not
    U+FFFD's), name it by them, and the text ends with U+FFFD as a full decode does."""
    first = default_tokenizer.encode("\U0001F600", add_special_tokens=False)[0]
    force = {str(first): 100}
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                         max_tokens=1, temperature=0, logit_bias=force,
                                         logprobs=True, top_logprobs=5)
    item = out.choices[0].logprobs.content[0]
    emoji = "\U0001F600".encode()
    assert 0 < len(item.bytes) < len(emoji) and bytes(item.bytes) == emoji[:len(item.bytes)]
    assert item.token == "bytes:" + "".join(f"\\x{b:02x}" for b in item.bytes)
    assert len(item.top_logprobs) == 5  # of the unbiased distribution
    assert out.choices[0].message.content == default_tokenizer.decode([first]) == "\ufffd"
    comp = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=1, temperature=0, logit_bias=force, logprobs=5)
    lp = comp.choices[0].logprobs
    assert lp.tokens == [item.token] and item.token in lp.top_logprobs[0]
    assert comp.choices[0].text == "\ufffd"


def test_echo(client):
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT)


def test_usage_chunk_when_asked(client):
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


async def _raw_stream(url: str, body: dict) -> tuple[aiohttp.ClientResponse, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r, await r.read()


def test_sse_framing_raw_bytes(server):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    resp, raw = asyncio.run(_raw_stream(server.url + "/v1/chat/completions", body))
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finish = [c["choices"][0]["index"] for c in chunks
              if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert sorted(finish) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all("index" in ch for c in chunks for ch in c["choices"])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_async_client_concurrent_streams(aclient_factory):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0, stream=True,
            messages=[{"role": "user", "content": f"Count to {i + 3}."}])
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        client = aclient_factory()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(4)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert all(text and reason in ("length", "stop") for text, reason in results)


def test_models_version_tokenize_health(server, client, default_tokenizer):
    models = client.models.list()
    (m,) = models.data
    assert m.id == "SmolLM2-135M-Instruct" and m.object == "model"
    assert m.model_extra["max_model_len"] == 2048
    assert requests.get(server.url + "/version").json()["version"]
    r = requests.get(server.url + "/health")
    assert r.status_code == 200 and r.content == b""
    tok = requests.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert tok["count"] == len(tok["tokens"]) == chat_prompt_len(default_tokenizer, CHAT)
    assert tok["max_model_len"] == 2048
    ids = requests.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    back = requests.post(server.url + "/detokenize", json={"tokens": ids}).json()
    assert back["prompt"] == PROMPT


def test_metrics_exposition(server, client):
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3,
                              temperature=0)
    text = requests.get(server.url + "/metrics").text
    for name in ("pagedserve:num_requests_running", "pagedserve:num_requests_waiting",
                 "pagedserve:kv_cache_usage_perc", "pagedserve:prompt_tokens_total",
                 "pagedserve:generation_tokens_total", "pagedserve:num_preemptions_total",
                 "pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total",
                 'pagedserve:request_success_total{finished_reason="length"',
                 "pagedserve:time_to_first_token_seconds_bucket",
                 "pagedserve:inter_token_latency_seconds_bucket",
                 "pagedserve:e2e_request_latency_seconds_bucket",
                 "pagedserve:request_queue_time_seconds_bucket"):
        assert name in text, name


def test_echo_with_logprobs_scores_the_prompt(client, default_model_path, default_tokenizer):
    """How evaluation harnesses score a text: the prompt's tokens each with its logprob
    given those before it (the first has none), then what was generated."""
    tok = default_tokenizer
    ids = tok.encode(PROMPT)
    p = len(ids)
    (chosen, _, top_v, _), = hf_prompt_logprobs(default_model_path, [ids], 2)
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=1,
                                    temperature=0, echo=True, logprobs=2)
    c = out.choices[0]
    lp = c.logprobs
    assert c.text.startswith(PROMPT) and len(lp.tokens) == p + 1
    assert lp.tokens[:p] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, p):
        assert abs(lp.token_logprobs[i] - chosen[i - 1]) < PROMPT_LOGPROB_TOL
        best = max(lp.top_logprobs[i].values())
        assert abs(best - top_v[i - 1][0]) < PROMPT_LOGPROB_TOL
        assert lp.tokens[i] in lp.top_logprobs[i] and 2 <= len(lp.top_logprobs[i]) <= 3
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(p)] + [len(PROMPT)]
    assert out.usage.prompt_tokens == p and out.usage.completion_tokens == 1
    # max_tokens=0: the prompt and its logprobs back, nothing generated.
    only = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=0, temperature=0, echo=True, logprobs=2)
    assert only.choices[0].text == PROMPT and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:p]
    assert only.choices[0].logprobs.text_offset == lp.text_offset[:p]
    assert only.usage.completion_tokens == 0
    # A prompt of the whole context (--max-model-len 2048) needs no room for a token.
    full = client.completions.create(model="SmolLM2-135M-Instruct", prompt=(ids * 500)[:2048],
                                     max_tokens=0, echo=True, logprobs=0)
    assert len(full.choices[0].logprobs.tokens) == 2048 and full.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:  # nothing to give back
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                           **{name: 0})
        assert err.value.body["param"] == name


def test_echo_with_logprobs_streamed_equals_whole(server):
    body = {"prompt": [PROMPT, "Hi there"], "max_tokens": 4, "temperature": 0, "n": 2,
            "echo": True, "logprobs": 1}
    whole = requests.post(server.url + "/v1/completions", json=body, timeout=60).json()
    _, raw = asyncio.run(_raw_stream(server.url + "/v1/completions", {**body, "stream": True}))
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    texts: dict[int, list[str]] = {}
    cols: dict[int, dict[str, list]] = {}
    for e in events[:-1]:
        (ch,) = json.loads(e)["choices"]
        k = ch["index"]
        if k not in texts:  # each choice opens with its prompt and the prompt's logprobs
            assert ch["text"] == [PROMPT, "Hi there"][k // 2]
            assert ch["logprobs"]["token_logprobs"][0] is None
        texts.setdefault(k, []).append(ch["text"])
        for name, v in ch["logprobs"].items():
            cols.setdefault(k, {}).setdefault(name, []).extend(v)
    for ch in whole["choices"]:
        k = ch["index"]
        assert "".join(texts[k]) == ch["text"] and cols[k] == ch["logprobs"]


def test_prompt_logprobs_field_on_both_routes(server, default_model_path, default_tokenizer):
    """vLLM's ``prompt_logprobs``: per prompt token null for the first, else {token id:
    {logprob, rank, decoded_token}} over the prompt token and its top candidates."""
    ids = default_tokenizer.encode(PROMPT)
    (chosen, ranks, top_v, top_i), = hf_prompt_logprobs(default_model_path, [ids], 1)
    url = server.url + "/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1, "n": 2}
    out = requests.post(url, json=body, timeout=60).json()
    assert out["choices"][0]["prompt_logprobs"] == out["choices"][1]["prompt_logprobs"]
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i, entry in enumerate(plp[1:]):
        mine = entry[str(ids[i + 1])]
        assert abs(mine["logprob"] - chosen[i]) < PROMPT_LOGPROB_TOL
        assert ranks[i][0] <= mine["rank"] <= ranks[i][1]
        assert mine["decoded_token"] == default_tokenizer.decode([ids[i + 1]])
        best = min(entry.values(), key=lambda c: c["rank"])
        assert best["rank"] == 1 and abs(best["logprob"] - top_v[i][0]) < PROMPT_LOGPROB_TOL
        assert len(entry) in (1, 2)
    chat = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": CHAT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat_prompt_len(default_tokenizer, CHAT)
    assert chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0: the token's own
    r = requests.post(url, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = requests.post(url, json={**body, "prompt_logprobs": 21}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
