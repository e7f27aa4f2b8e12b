"""Logprobs through the real server (subprocess, default model): sampled tokens' logprobs
and their text offsets, echoed prompts scored against HF transformers, and vLLM's
``prompt_logprobs``."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.helpers.hf import PROMPT_LOGPROB_TOL, hf_prompt_logprobs
from tests.helpers.server import sse_events
from tests.helpers.server_checks import CHAT, PROMPT, chat_prompt_len

COUNT = "1, 2, 3, 4,"  # the default model continues " 5, 6, 7, 8, 9, ..." greedily


@pytest.mark.parametrize("stop", ["7, 8", "5, 7"])  # a stop string hit, and one held back
def test_logprobs_go_out_with_their_text_and_never_for_a_stop_string(api_client, stop):
    """Logprobs are the tokens of the text the client gets: a chunk whose text is held
    back (it may start a stop string) holds back their logprobs too, and a stop string's
    tokens have none."""
    kw = dict(model="SmolLM2-135M-Instruct", prompt=COUNT, max_tokens=12, temperature=0,
              stop=stop, logprobs=0)
    whole = api_client.completions.create(**kw).choices[0]
    assert "".join(whole.logprobs.tokens) == whole.text  # these tokens decode one by one
    streamed = ""
    for chunk in api_client.completions.create(**kw, stream=True):
        (c,) = chunk.choices
        tokens = c.logprobs.tokens if c.logprobs is not None else []
        assert "".join(tokens) == c.text, chunk
        streamed += c.text
    assert streamed == whole.text
    chat = api_client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=60, temperature=0, stop="11, 12",
        logprobs=True, messages=[{"role": "user", "content": "Count from 1 to 20 separated "
                                  "by commas, like 1, 2, 3"}])  # fmt: skip
    assert chat.choices[0].finish_reason == "stop"
    content = chat.choices[0].message.content
    assert "".join(t.token for t in chat.choices[0].logprobs.content) == content


def test_chat_logprobs_shape(api_client):
    out = api_client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
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


def test_completion_logprobs_shape(api_client):
    out = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    streamed = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                         max_tokens=5, temperature=0, logprobs=2, stream=True)
    offsets = [o for c in streamed if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_completion_text_offsets_index_the_text_past_split_characters(api_client):
    """``text_offset`` is where each token's text begins in the text: a character split
    over several tokens (CJK here) takes one place in the text, not one per token."""
    kw = dict(model="SmolLM2-135M-Instruct", prompt="Chinese numbers: 一, 二, 三, 四,",
              max_tokens=12, temperature=0, logprobs=0)
    out = api_client.completions.create(**kw).choices[0]
    text, lp = out.text, out.logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens)  # some tokens split a character
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    clean = [(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True)
             if not t.startswith("bytes:")]
    assert clean and all(text[o:o + len(t)] == t for t, o in clean), (text, lp)
    streamed = [o for c in api_client.completions.create(**kw, stream=True)
                if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.text_offset


def test_logprobs_of_part_of_a_character(api_client, default_tokenizer):
    """A token holding only some bytes of a character: logprobs give its own bytes (not
    U+FFFD's), name it by them, and the text ends with U+FFFD as a full decode does."""
    first = default_tokenizer.encode("\U0001F600", add_special_tokens=False)[0]
    force = {str(first): 100}
    out = api_client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                         max_tokens=1, temperature=0, logit_bias=force,
                                         logprobs=True, top_logprobs=5)
    item = out.choices[0].logprobs.content[0]
    emoji = "\U0001F600".encode()
    assert 0 < len(item.bytes) < len(emoji) and bytes(item.bytes) == emoji[:len(item.bytes)]
    assert item.token == "bytes:" + "".join(f"\\x{b:02x}" for b in item.bytes)
    assert len(item.top_logprobs) == 5  # of the unbiased distribution
    assert out.choices[0].message.content == default_tokenizer.decode([first]) == "\ufffd"
    comp = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=1, temperature=0, logit_bias=force, logprobs=5)
    lp = comp.choices[0].logprobs
    assert lp.tokens == [item.token] and item.token in lp.top_logprobs[0]
    assert comp.choices[0].text == "\ufffd"


def test_echo_with_logprobs_scores_the_prompt(api_client, default_model_path, default_tokenizer):
    """How evaluation harnesses score a text: the prompt's tokens each with its logprob
    given those before it (the first has none), then what was generated."""
    tok = default_tokenizer
    ids = tok.encode(PROMPT)
    p = len(ids)
    (chosen, _, top_v, _), = hf_prompt_logprobs(default_model_path, [ids], 2)
    out = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=1,
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
    only = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=0, temperature=0, echo=True, logprobs=2)
    assert only.choices[0].text == PROMPT and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:p]
    assert only.choices[0].logprobs.text_offset == lp.text_offset[:p]
    assert only.usage.completion_tokens == 0
    # A prompt of the whole context (--max-model-len 2048) needs no room for a token.
    full = api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=(ids * 500)[:2048],
                                     max_tokens=0, echo=True, logprobs=0)
    assert len(full.choices[0].logprobs.tokens) == 2048 and full.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:  # nothing to give back
        api_client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as err:
            api_client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                           **{name: 0})
        assert err.value.body["param"] == name


def test_echo_with_logprobs_streamed_equals_whole(api_server):
    body = {"prompt": [PROMPT, "Hi there"], "max_tokens": 4, "temperature": 0, "n": 2,
            "echo": True, "logprobs": 1}
    whole = requests.post(api_server.url + "/v1/completions", json=body, timeout=60).json()
    raw = requests.post(api_server.url + "/v1/completions", json={**body, "stream": True},
                        timeout=60).content
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


def test_prompt_logprobs_field_on_both_routes(api_server, default_model_path, default_tokenizer):
    """vLLM's ``prompt_logprobs``: per prompt token null for the first, else {token id:
    {logprob, rank, decoded_token}} over the prompt token and its top candidates."""
    ids = default_tokenizer.encode(PROMPT)
    (chosen, ranks, top_v, top_i), = hf_prompt_logprobs(default_model_path, [ids], 1)
    url = api_server.url + "/v1/completions"
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
    chat = requests.post(api_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": CHAT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat_prompt_len(default_tokenizer, CHAT)
    assert chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0: the token's own
    r = requests.post(url, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = requests.post(url, json={**body, "prompt_logprobs": 21}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
