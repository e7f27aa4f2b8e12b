"""Request structs -> ``SamplingParams``; fields the server cannot honour are 400s."""

from __future__ import annotations

from typing import Any

from pagedserve import MAX_LOGPROBS, SamplingParamError, SamplingParams, StructuredOutputsParams
from pagedserve.server.errors import bad_request
from pagedserve.server.param_names import (
    CHAT,
    CHAT_MAX_COMPLETION_TOKENS,
    COMPLETIONS,
    Route,
    input_error,
)
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling

COMPLETION_DEFAULT_MAX_TOKENS = 16


def _common(req: _Sampling, defaults: dict[str, Any] | None) -> dict[str, Any]:
    """Sampling keyword arguments shared by chat and completions (None = default:
    ``defaults``, the model's own, or the engine's)."""
    kw: dict[str, Any] = {
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": req.logit_bias,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "priority": req.priority,
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words,
    }
    for name, value in (defaults or {}).items():
        if kw.get(name) is None:
            kw[name] = value
    if req.cache_salt is not None and not req.cache_salt:
        raise bad_request("cache_salt must be a non-empty string when given", "cache_salt")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if req.prompt_logprobs is not None:
        if req.stream:
            raise bad_request("prompt_logprobs is not available with stream=true",
                              "prompt_logprobs")
        kw["prompt_logprobs"] = req.prompt_logprobs
    return kw


def _build(kw: dict[str, Any], route: Route) -> SamplingParams:
    try:
        return SamplingParams(
            **{k: v for k, v in kw.items() if v is not None or k == "max_tokens"})
    except SamplingParamError as e:
        # Named as the client sent it (``max_completion_tokens``, ``top_logprobs``).
        raise input_error(e, route) from None


def embedding_params(priority: int, route: Route) -> SamplingParams:
    """An embedding request's parameters: no output tokens, its ``priority``."""
    return _build({"max_tokens": 0, "priority": priority}, route)


def _unsupported(value: Any, allowed: tuple, param: str, what: str) -> None:
    if value is not None and value not in allowed:
        raise bad_request(f"{param} is not supported by this server: {what}", param)


def chat_params(req: ChatCompletionRequest, structured: StructuredOutputsParams | None = None,
                defaults: dict[str, Any] | None = None) -> tuple[SamplingParams, Route]:
    """Sampling parameters of a chat request and how the request names its fields (its
    token limit is ``max_completion_tokens`` or ``max_tokens``). ``structured`` is the
    request's constraint (``pagedserve.server.structured``, ``pagedserve.server.tools``).

    ``max_tokens`` of the result is None when the request sets no limit.
    """
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise bad_request("only the 'text' modality is supported", "modalities")
    if req.audio is not None:
        raise bad_request("audio output is not supported", "audio")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs={req.top_logprobs!r} is invalid: must be an "
                              f"integer in [0, {MAX_LOGPROBS}]", "top_logprobs")  # fmt: skip
        if req.top_logprobs > 0 and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    kw = _common(req, defaults)
    route = CHAT_MAX_COMPLETION_TOKENS if req.max_completion_tokens is not None else CHAT
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit == 0:
        raise bad_request(f"{route.max_tokens}=0 is invalid: must be an integer >= 1",
                          route.max_tokens)  # fmt: skip
    kw["max_tokens"] = limit
    kw["structured_outputs"] = structured
    if req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
    return _build(kw, route), route


def completion_params(req: CompletionRequest,
                      structured: StructuredOutputsParams | None = None,
                      defaults: dict[str, Any] | None = None) -> SamplingParams:
    """Sampling parameters of a completions request (``max_tokens`` defaults to 16)."""
    if req.suffix:
        raise bad_request("suffix is not supported by this server (no fill-in-the-middle)",
                          "suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of different from n is not supported", "best_of")
    kw = _common(req, defaults)
    kw["max_tokens"] = (req.max_tokens if req.max_tokens is not None
                        else COMPLETION_DEFAULT_MAX_TOKENS)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 is invalid: must be an integer >= 1 (0 is for echo: "
                          "the prompt back, nothing generated)", "max_tokens")
    kw["logprobs"] = req.logprobs
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens get theirs
        kw["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    kw["structured_outputs"] = structured
    return _build(kw, COMPLETIONS)
