"""Request decoding: a large body decoded in pieces gives what a whole decode gives,
errors included (same status, same parameter named)."""

from __future__ import annotations

import msgspec
import pytest

from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    decode_body,
    decode_large_body,
)

MSGS = [{"role": "user", "content": f"m{i}"} for i in range(3000)]
BODIES = [
    (ChatCompletionRequest, {"messages": MSGS, "temperature": 0.5, "stop": ["a", "b"],
                             "logit_bias": {"5": 1.0}, "stream_options": None, "extra": 1}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x" * 9000}]}] * 3}),
    (CompletionRequest, {"prompt": list(range(5000)), "n": 2}),
    (CompletionRequest, {"prompt": [list(range(3000)), [1, 2]], "echo": True}),
    (CompletionRequest, {"prompt": "y" * 10000, "max_tokens": None}),
    (DetokenizeRequest, {"tokens": list(range(6000))}),
]
BAD = [
    (ChatCompletionRequest, {"messages": MSGS[:2000] + [{"role": 5}]}, "messages"),
    (ChatCompletionRequest, {"messages": MSGS, "n": "2"}, "n"),
    (ChatCompletionRequest, {"messages": "hi" * 3000}, "messages"),
    (CompletionRequest, {"prompt": list(range(5000)), "temperature": "HUGE"}, "temperature"),
    (DetokenizeRequest, {"model": "x" * 9000}, "tokens"),
    (DetokenizeRequest, {"tokens": list(range(5000)) + ["x"]}, "tokens"),
]


@pytest.mark.parametrize("i", range(len(BODIES)))
def test_large_decode_equals_whole_decode(i):
    kind, obj = BODIES[i]
    body = msgspec.json.encode(obj)
    assert decode_large_body(body, kind) == decode_body(body, kind)


def _error(fn, body, kind) -> APIError:
    with pytest.raises(APIError) as info:
        fn(body, kind)
    return info.value


@pytest.mark.parametrize("i", range(len(BAD)))
def test_large_decode_names_the_same_parameter(i):
    kind, obj, param = BAD[i]
    # Valid JSON, but a number past float64.
    body = msgspec.json.encode(obj).replace(b'"HUGE"', b"1e400")
    whole, large = _error(decode_body, body, kind), _error(decode_large_body, body, kind)
    assert whole.status == large.status == 400
    assert whole.param == large.param == param, (whole.message, large.message)


@pytest.mark.parametrize("body", [b"[" * 5000 + b"]" * 5000, b"[1, 2]", b"{not json",
                                  b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_large_decode_refuses_what_whole_decode_refuses(body):
    for fn in (decode_body, decode_large_body):
        err = _error(fn, body, ChatCompletionRequest)
        assert err.status == 400 and err.param in (None, "messages")
