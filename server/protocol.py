"""OpenAI-compatible request bodies (msgspec structs) and their decoding.

Unknown fields are ignored, as vLLM does by default (OpenAI SDKs and wrappers send
extras); the names of ignored fields are logged once each. Optional fields are
``X | None = None`` so that clients sending explicit ``null``s are accepted; defaults
are applied in :mod:`server.params`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

import msgspec

from server.errors import bad_request

logger = logging.getLogger("server")

T = TypeVar("T")


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str


class _Sampling(msgspec.Struct):
    """Fields shared by chat and completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Engine extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    add_generation_prompt: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[Any] | None = None
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


_AT = re.compile(r"at `\$\.([A-Za-z_]\w*)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]\w*)`")
_warned: set[str] = set()


def _param_of(message: str) -> str | None:
    m = _AT.search(message) or _MISSING.search(message)
    return m.group(1) if m else None


def decode_body(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into ``kind``; every failure is a 400 naming the field."""
    try:
        obj = msgspec.json.decode(body)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except msgspec.DecodeError as e:
        if "Number out of range" in str(e):
            # Valid JSON with a number past float64: decode against the schema to learn
            # which field holds it.
            try:
                msgspec.json.decode(body, type=kind)
            except RecursionError:
                raise bad_request("the request body is nested too deeply") from None
            except (msgspec.ValidationError, msgspec.DecodeError) as typed:
                msg = str(typed)
                raise bad_request(f"invalid request: {msg}", _param_of(msg)) from None
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        req = msgspec.convert(obj, kind)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except msgspec.ValidationError as e:
        msg = str(e)
        raise bad_request(f"invalid request: {msg}", _param_of(msg)) from None
    unknown = obj.keys() - set(kind.__struct_fields__)
    for name in unknown - _warned:
        if len(_warned) >= 256:
            break
        _warned.add(name)
        logger.warning("ignoring unknown request field %r (%s)", name, kind.__name__)
    return req
