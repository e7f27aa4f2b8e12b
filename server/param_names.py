"""The engine's input fields as each OpenAI route names them: the one table.

The engine's errors name an :class:`~engine.InputField`; a 400 names the parameter as
the client sent it. Most fields share the engine's name; the prompt is ``messages`` on
the chat route and ``prompt`` on completions, the token limit is ``max_completion_tokens``
on chat when the client used that spelling, and chat's logprob count is ``top_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve import EngineInputError, InputField
from pagedserve.server.errors import APIError, bad_request


@dataclass(frozen=True, slots=True)
class Route:
    """How one route (or one request of it) names the fields that differ by route."""

    prompt: str
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"
    lora_request: str = "model"
    """A LoRA adapter is named by ``model`` on every route."""


COMPLETIONS = Route(prompt="prompt")
CHAT = Route(prompt="messages", logprobs="top_logprobs")
CHAT_MAX_COMPLETION_TOKENS = Route(prompt="messages", max_tokens="max_completion_tokens",
                                   logprobs="top_logprobs")  # fmt: skip
DETOKENIZE = Route(prompt="tokens")

_BY_ROUTE = {InputField.PROMPT: "prompt", InputField.MAX_TOKENS: "max_tokens",
             InputField.LOGPROBS: "logprobs", InputField.LORA_REQUEST: "lora_request"}  # fmt: skip
"""Fields whose name is an attribute of :class:`Route`; every other field's OpenAI name is
its engine name (``temperature``, ``logit_bias``, ``stop_token_ids``, ...)."""


def api_param(field: InputField, route: Route) -> str:
    """The parameter name a client of ``route`` knows ``field`` by."""
    attr = _BY_ROUTE.get(field)
    return getattr(route, attr) if attr is not None else field.value


def api_message(message: str, field: InputField, route: Route) -> str:
    """An engine message that starts with ``field=`` renamed to the client's name."""
    name = api_param(field, route)
    prefix = f"{field.value}="
    if name != field.value and message.startswith(prefix):
        return f"{name}={message[len(prefix):]}"
    return message


def input_error(exc: EngineInputError, route: Route) -> APIError:
    """The 400 for an engine input error, naming the parameter as ``route`` does."""
    return bad_request(api_message(str(exc), exc.field, route), api_param(exc.field, route))
