"""Bad input gets its status and a JSON error naming the parameter; nobody else notices.

Also: a client that disconnects aborts its request and its KV blocks return to the pool.
"""

from __future__ import annotations

import openai
import pytest
import requests

from tests.helpers.server import ServerProcess
from tests.helpers.server_checks import (
    aborted,
    disconnected_request_freed,
    finished,
    stream_disconnect_frees_blocks,
)

SERVER_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
               "--max-model-len", "2048", "--dtype", "float32", "--log-level", "warning"]
MSG = [{"role": "user", "content": "Hello"}]
LONG = "hello " * 2100  # over the 2048-token context


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(SERVER_ARGS) as srv:
        yield srv


def chat(**kw):
    return {"messages": MSG, "max_tokens": 4, **kw}


def comp(**kw):
    return {"prompt": "Hello", "max_tokens": 4, **kw}


CHAT, COMP = "/v1/chat/completions", "/v1/completions"

# (route, body, expected status, expected param); body None = not JSON.
CASES = {
    "not_json": (CHAT, b"{not json", 400, None),
    "json_array": (CHAT, [1, 2], 400, None),
    "wrong_type_n": (CHAT, chat(n="2"), 400, "n"),
    "wrong_type_stream": (CHAT, chat(stream="yes"), 400, "stream"),
    "wrong_type_messages": (CHAT, {"messages": "hi"}, 400, "messages"),
    "missing_messages": (CHAT, {"max_tokens": 4}, 400, "messages"),
    "bad_role": (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages"),
    "null_user_content": (CHAT, chat(messages=[{"role": "user", "content": None}]), 400,
                          "messages"),
    "image_part": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages"),
    "temperature_range": (CHAT, chat(temperature=-0.5), 400, "temperature"),
    "top_p_range": (CHAT, chat(top_p=0), 400, "top_p"),
    "n_range": (CHAT, chat(n=0), 400, "n"),
    "top_logprobs_range": (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "top_logprobs_needs_logprobs": (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    "top_logprobs_negative": (CHAT, chat(top_logprobs=-1), 400, "top_logprobs"),
    # Valid JSON, but past float64: the field is still named.
    "temperature_overflow": (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], '
                                   b'"temperature": 1e400}', 400, "temperature"),
    "logit_bias_overflow": (COMP, b'{"prompt": "Hi", "logit_bias": {"5": -1e400}}', 400,
                            "logit_bias"),
    "max_completion_tokens_zero": (CHAT, chat(max_completion_tokens=0), 400,
                                   "max_completion_tokens"),
    "presence_penalty_range": (CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    "stop_token_ids_range": (CHAT, chat(stop_token_ids=[10**7]), 400, "stop_token_ids"),
    "logit_bias_key": (CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    "unknown_model": (CHAT, chat(model="gpt-4o"), 404, "model"),
    "prompt_too_long": (CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400,
                        "messages"),
    "max_tokens_too_large": (CHAT, chat(max_tokens=5000), 400, "max_tokens"),
    "tools": (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
              "tools"),
    "tool_choice": (CHAT, chat(tool_choice="auto"), 400, "tool_choice"),
    "response_format": (CHAT, chat(response_format={"type": "xml"}), 400,
                        "response_format"),
    "modalities_audio": (CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    "stream_options_without_stream": (CHAT, chat(stream_options={"include_usage": True}),
                                      400, "stream_options"),
    "completion_suffix": (COMP, comp(suffix="end"), 400, "suffix"),
    "completion_missing_prompt": (COMP, {"max_tokens": 4}, 400, "prompt"),
    "completion_mixed_prompt": (COMP, comp(prompt=["a", 1]), 400, "prompt"),
    "completion_token_range": (COMP, comp(prompt=[1, 2, 10**7]), 400, "prompt"),
    "completion_logprobs_range": (COMP, comp(logprobs=21), 400, "logprobs"),
    "completion_prompt_too_long": (COMP, comp(prompt=LONG), 400, "prompt"),
    "completion_max_tokens_too_large": (COMP, comp(max_tokens=4000), 400, "max_tokens"),
    "completion_empty_prompt": (COMP, comp(prompt=""), 400, "prompt"),
    "detokenize_range": ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(server, case):
    route, body, status, param = CASES[case]
    if isinstance(body, bytes):
        r = requests.post(server.url + route, data=body,
                          headers={"Content-Type": "application/json"})
    else:
        r = requests.post(server.url + route, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_message_names_the_field_sent(server):
    """A limit checked under the engine's name is reported under the client's."""
    for body, name in ((chat(max_completion_tokens=0), "max_completion_tokens"),
                       (chat(logprobs=True, top_logprobs=21), "top_logprobs")):
        err = requests.post(server.url + CHAT, json=body).json()["error"]
        assert err["param"] == name and err["message"].startswith(f"{name}="), err


def test_length_error_says_the_numbers(server):
    r = requests.post(server.url + CHAT, json=chat(max_tokens=5000))
    msg = r.json()["error"]["message"]
    assert "2048" in msg and "5000" in msg
    prompt_tokens = requests.post(server.url + "/tokenize", json={"messages": MSG}).json()["count"]
    assert str(prompt_tokens) in msg


def test_wrong_content_type(server):
    r = requests.post(server.url + CHAT, data="messages=hi",
                      headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_unknown_route_is_json(server):
    r = requests.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_sdk_sees_the_error(server):
    client = server.openai_client("x")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG,
                                       temperature=7000)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    # ... and the server still answers normal requests.
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG,
                                         max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_stream_disconnect_aborts_and_frees_blocks(server):
    stream_disconnect_frees_blocks(server.url, MSG)


def test_whole_request_disconnect_aborts(server):
    before = aborted(server.url), finished(server.url, "length")
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + CHAT, json=chat(max_tokens=1500, ignore_eos=True),
                      timeout=(5, 0.5))
    disconnected_request_freed(server.url, before)
    r = requests.post(server.url + CHAT, json=chat(max_tokens=2, temperature=0))
    assert r.status_code == 200
