"""OpenAI-compatible request bodies (msgspec structs) and their decoding.

Unknown fields are ignored, as vLLM does by default (OpenAI SDKs and wrappers send
extras); the names of ignored fields are logged once each. Optional fields are
``X | None = None`` so that clients sending explicit ``null``s are accepted; defaults
are applied in :mod:`pagedserve.server.params`.
"""

from __future__ import annotations

import logging
import re
import types
import typing
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from pagedserve.server.errors import bad_request
from pagedserve.server.sse import read_json
from pagedserve.server.state import STATE_KEY

logger = logging.getLogger("pagedserve.server")

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
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: str | None = None
    schema: Any = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None


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
    prompt_logprobs: int | None = None
    priority: int | None = None
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Structured outputs (vLLM's spellings)
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[Any] | None = None
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None


class ResponsesRequest(_Sampling):
    """``POST /v1/responses`` (the Responses API): stateless, function tools only."""

    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(msgspec.Struct):
    """``POST /v1/embeddings``."""

    input: str | list[Any] | None = None
    model: str | None = None
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    """vLLM's extra: L2-normalize the vector (default: the model's pooling)."""
    priority: int = 0


class ScoreRequest(msgspec.Struct):
    """``POST /v1/score``: ``text_1`` against ``text_2`` (strings or lists of strings)."""

    text_1: Any = None
    text_2: Any = None
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankRequest(msgspec.Struct):
    """``POST /v1/rerank`` (Jina / Cohere): ``documents`` by relevance to ``query``."""

    query: Any = None
    documents: Any = None
    model: str | None = None
    top_n: int | None = None
    return_documents: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


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
    _warn_unknown(obj.keys() - set(kind.__struct_fields__), kind)
    return req


LARGE_BODY_BYTES = 256 * 2**10
"""Bodies above this are decoded on the tokenizer thread, one list item at a time."""
_RAW_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])


async def read_request(request: web.Request, kind: type[T]) -> T:
    """Read and decode a JSON body into ``kind``. A large body is decoded off the event
    loop in pieces: msgspec holds the GIL for a whole call, so one call over a body of
    many small items would stall the loop for its whole length."""
    body = await read_json(request)
    if len(body) <= LARGE_BODY_BYTES:
        return decode_body(body, kind)
    return await request.app[STATE_KEY].offload(decode_large_body, body, kind)


def _list_item_type(tp: Any) -> Any:
    """The item type of ``list[X]`` (also inside a union), else None."""
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if typing.get_origin(arg) is list:
                return typing.get_args(arg)[0]
    return None


def _invalid(e: Exception, path: str) -> Exception:
    """A field decoded on its own reports ``$``: name it as the whole body would."""
    msg = str(e).replace("`$", f"`$.{path}")
    if "at `$." not in msg:
        msg = f"{msg} - at `$.{path}`"
    return bad_request(f"invalid request: {msg}", _param_of(msg))


def _decode_field(raw: msgspec.Raw, name: str, tp: Any) -> Any:
    view = memoryview(raw)
    item_tp = _list_item_type(tp)
    try:
        if item_tp is None or len(view) <= 4096 or bytes(view[:1]) != b"[":
            return msgspec.json.decode(raw, type=tp)
        items = _RAW_LIST.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise _invalid(e, name) from None
    out = []
    for i, item in enumerate(items):
        try:
            out.append(msgspec.json.decode(item, type=item_tp))
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise _invalid(e, f"{name}[{i}]") from None
    return out


def decode_large_body(body: bytes, kind: type[T]) -> T:
    """:func:`decode_body` in pieces (same result, same errors): the top-level object is
    scanned once, then each field is decoded on its own and each item of a long list
    separately, so that the interpreter can switch threads between them."""
    try:
        top = _RAW_OBJECT.decode(body)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except msgspec.ValidationError as e:
        raise bad_request(f"the request body must be a JSON object: {e}") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    values: dict[str, Any] = {}
    try:
        for f in msgspec.structs.fields(kind):
            raw = top.pop(f.encode_name, None)
            if raw is not None:
                values[f.name] = _decode_field(raw, f.name, f.type)
            elif f.required:
                raise bad_request(
                    f"invalid request: Object missing required field `{f.name}`", f.name)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    _warn_unknown(top.keys(), kind)
    return kind(**values)


def _warn_unknown(names: typing.Iterable[str], kind: type) -> None:
    for name in set(names) - _warned:
        if len(_warned) >= 256:
            break
        _warned.add(name)
        logger.warning("ignoring unknown request field %r (%s)", name, kind.__name__)
