"""The real server (subprocess, default model) through the official ``openai`` client:
models, streaming, stop strings, sampling options, SSE framing, metrics. Its logprobs are
tested in ``test_api_logprobs.py`` on the same server (``conftest.py``)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import requests

from tests.helpers.server import sse_events
from tests.helpers.server_checks import CHAT, PROMPT, chat_prompt_len, chat_stream_equals_whole


def test_models_list_and_retrieve(api_client):
    (card,) = api_client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct" and card.object == "model"
    got = api_client.models.retrieve("SmolLM2-135M-Instruct")
    assert got.model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError) as err:
        api_client.models.retrieve("org/no-such-model")
    assert err.value.body["param"] == "model" and "org/no-such-model" in err.value.body["message"]


def test_chat_stream_equals_whole(api_client, default_tokenizer):
    chat_stream_equals_whole(api_client, default_tokenizer, CHAT)


def test_completion_stream_equals_whole(api_client, default_tokenizer):
    whole = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                      max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.usage.prompt_tokens == len(default_tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == 12
    stream = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_completion_default_max_tokens_and_prompt_lists(api_client):
    out = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=[PROMPT, "Hi"],
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens <= 32
    assert all(c.finish_reason in ("length", "stop") for c in out.choices)
    ids = requests.post(api_client.base_url.join("/tokenize").__str__(),
                        json={"prompt": PROMPT}).json()["tokens"]
    by_ids = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=[ids, ids[:3]],
                                       max_tokens=4, temperature=0, n=2)
    assert [c.index for c in by_ids.choices] == [0, 1, 2, 3]
    assert by_ids.usage.prompt_tokens == len(ids) + 3


def test_stop_string_never_leaks(api_client):
    free = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=24, temperature=0).choices[0].text
    words = free.split()
    stop = next(w for w in words[2:] if len(w) >= 3)
    expected = free[:free.index(stop)]
    out = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == expected
    streamed = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                         max_tokens=24, temperature=0, stop=stop, stream=True)
    text = "".join(c.choices[0].text for c in streamed)
    assert text == expected and stop not in text


def test_include_stop_str_and_logit_bias(api_client, default_tokenizer):
    free = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=24, temperature=0).choices[0].text
    stop = next(w for w in free.split()[2:] if len(w) >= 3)
    out = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == free[:free.index(stop) + len(stop)]
    (tid,) = default_tokenizer.encode(" banana", add_special_tokens=False)[:1]
    biased = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=3, temperature=0, logprobs=0,
                                       logit_bias={str(tid): 100})
    assert biased.choices[0].logprobs.tokens == [default_tokenizer.decode([tid])] * 3


def test_n2_stream_carries_indexes(api_client):
    stream = api_client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
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


def test_same_seed_same_text(api_client):
    kw = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=12, temperature=1.0,
              seed=1234)
    a = api_client.chat.completions.create(**kw).choices[0].message.content
    b = api_client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_echo(api_client):
    out = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT)


def test_usage_chunk_when_asked(api_client):
    stream = api_client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
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


def test_sse_framing_raw_bytes(api_server):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    resp, raw = asyncio.run(_raw_stream(api_server.url + "/v1/chat/completions", body))
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


def test_async_client_concurrent_streams(api_aclient_factory):
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
        client = api_aclient_factory()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(4)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert all(text and reason in ("length", "stop") for text, reason in results)


def test_models_version_tokenize_health(api_server, api_client, default_tokenizer):
    models = api_client.models.list()
    (m,) = models.data
    assert m.id == "SmolLM2-135M-Instruct" and m.object == "model"
    assert m.model_extra["max_model_len"] == 2048
    assert requests.get(api_server.url + "/version").json()["version"]
    r = requests.get(api_server.url + "/health")
    assert r.status_code == 200 and r.content == b""
    tok = requests.post(api_server.url + "/tokenize", json={"messages": CHAT}).json()
    assert tok["count"] == len(tok["tokens"]) == chat_prompt_len(default_tokenizer, CHAT)
    assert tok["max_model_len"] == 2048
    ids = requests.post(api_server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    back = requests.post(api_server.url + "/detokenize", json={"tokens": ids}).json()
    assert back["prompt"] == PROMPT


def test_metrics_exposition(api_server, api_client):
    api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3,
                              temperature=0)
    text = requests.get(api_server.url + "/metrics").text
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
