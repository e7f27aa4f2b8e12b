"""``/v1/responses`` requests in the chat route's terms: input items as chat messages,
function tools and ``tool_choice`` in chat's shape, ``text.format`` as a constraint.

A conversation is sent whole in ``input`` (earlier outputs as items: ``message``,
``reasoning``, ``function_call``), with the results of calls as ``function_call_output``
items, or continued from a stored response (``previous_response_id``, which
:mod:`pagedserve.server.responses` resolves into these items first). ``conversation`` and
``background`` are refused with a 400 naming them.
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.errors import bad_request
from pagedserve.server.param_names import Route
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ResponsesRequest,
    _Sampling,
)
from pagedserve.server.structured import Constraint, _make

RESPONSES = Route(prompt="input", max_tokens="max_output_tokens", logprobs="top_logprobs")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` value served; the others name data this server does not produce
(encrypted reasoning, search results, images) and are ignored."""


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the message's ``output_text`` carries logprobs: ``include`` asks for them
    (``top_logprobs`` alone, as OpenAI's API, leaves them empty)."""
    return LOGPROBS_INCLUDE in (req.include or ())
ROLES = ("user", "system", "developer", "assistant")
_JSON_TYPES = {list: "an array", dict: "an object", bool: "a boolean"}
ITEM_TYPES = ("message", "reasoning", "function_call", "function_call_output")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates what ``req`` asks for (validated on the way)."""
    if req.conversation is not None:
        raise bad_request("conversation is not supported: continue a stored response with "
                          "previous_response_id, or send the whole conversation in input",
                          "conversation")
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.n not in (None, 1):
        raise bad_request(f"n={req.n!r} is invalid: a response has one output", "n")
    limit = req.max_output_tokens
    if limit is not None and (isinstance(limit, bool) or limit < 1):
        raise bad_request(f"max_output_tokens={limit!r} is invalid: must be an integer >= 1",
                          "max_output_tokens")
    if req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported on /v1/responses; use "
                          "/v1/completions", "prompt_logprobs")
    fields = {f: getattr(req, f) for f in _Sampling.__struct_fields__}
    return ChatCompletionRequest(
        # top_logprobs alone is still checked (0-20), as the chat route checks it.
        **fields, logprobs=wants_logprobs(req) or req.top_logprobs is not None,
        top_logprobs=req.top_logprobs,
        messages=input_messages(req.input, req.instructions),
        max_completion_tokens=limit, tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        chat_template_kwargs=req.chat_template_kwargs)


def _text(content: Any, where: str) -> str:
    """A message's (or a call output's) text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts",
                          "input")
    texts, kinds = [], set()
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise bad_request(f"{where}.content[{j}] has type {kind!r}; only text parts "
                              "(input_text, output_text) are supported", "input")
        texts.append(part["text"])
        kinds.add(kind)
    return ("" if kinds == {"output_text"} else "\n").join(texts)


def input_messages(items: str | list[dict[str, Any]] | None,
                   instructions: str | None) -> list[ChatMessage]:
    msgs = [] if instructions is None else [ChatMessage("system", instructions)]
    if items is None:
        raise bad_request("input is required", "input")
    if isinstance(items, str):
        return [*msgs, ChatMessage("user", items)]
    if not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    thought: str | None = None  # a reasoning item, for the assistant turn that follows
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise bad_request(f"{where}.id must be a string, got "
                              f"{_JSON_TYPES.get(type(item['id']), 'a number')}", "input")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role {role!r} is not supported; use one of "
                                  f"{', '.join(ROLES)}", "input")
            msgs.append(ChatMessage(role, _text(item.get("content"), where)))
            if role == "assistant":
                msgs[-1].reasoning_content, thought = thought, None
        elif kind == "function_call":
            call = {k: item.get(k) for k in ("call_id", "name", "arguments")}
            if not all(isinstance(v, str) for v in call.values()):
                raise bad_request(f"{where} (function_call) needs call_id, name and "
                                  "arguments as strings", "input")
            entry = {"id": call["call_id"], "type": "function",
                     "function": {"name": call["name"], "arguments": call["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is not None and last.role == "assistant" and thought is None:
                last.tool_calls = [*(last.tool_calls or []), entry]  # the same turn
            else:
                msgs.append(ChatMessage("assistant", None, tool_calls=[entry],
                                        reasoning_content=thought))
                thought = None
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where} (function_call_output) needs a call_id", "input")
            msgs.append(ChatMessage("tool", _text(item.get("output"), where),
                                    tool_call_id=item["call_id"]))
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise bad_request(f"{where}.content (reasoning) must be a list of "
                                  "reasoning_text parts", "input")
            thought = "\n".join(p["text"] for p in parts if isinstance(p, dict)
                                and isinstance(p.get("text"), str)) or None
        else:
            raise bad_request(f"{where} has type {kind!r}; supported: "
                              f"{', '.join(ITEM_TYPES)}", "input")
    return msgs


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Responses' flat function tools (``{"type", "name", "parameters"}``) in chat's
    shape; any other tool type is a 400."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}] has type {kind!r}: only function tools are "
                              "supported", "tools")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice  # "none", "auto", "required" (anything else: chat's 400)
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": "
                      "\"function\", \"name\": ...}", "tool_choice")


def text_constraint(req: ResponsesRequest) -> Constraint | None:
    """``text.format``: plain text, any JSON object, or a JSON schema."""
    text = req.text or {}
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return _make("text", {"json_object": "text.format"}, json_object=True)
    if kind == "json_schema":
        if fmt.get("schema") is None:
            raise bad_request("text.format.schema is required with type 'json_schema'",
                              "text")
        return _make("text", {"json": "text.format.schema"}, json=fmt["schema"])
    raise bad_request(f"text.format type {kind!r} is not supported; use 'text', "
                      "'json_object' or 'json_schema'", "text")
