"""Prompts: chat messages through the chat template, completion prompts normalised."""

from __future__ import annotations

import inspect
from typing import Any

from pagedserve.engine.errors import JSONTextError
from pagedserve.engine.jsonlimits import decode_json
from pagedserve.server.errors import bad_request
from pagedserve.server.generation import Prompt
from pagedserve.server.param_names import COMPLETIONS, Route
from pagedserve.server.protocol import ChatMessage
from pagedserve.server.state import ServerState

ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "developer": "system"}
MAX_PROMPTS = 256


def messages_to_dicts(messages: list[ChatMessage] | None) -> list[dict[str, Any]]:
    """Validate roles and content parts; return template-ready ``{"role","content"}`` dicts."""
    if not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = ROLES.get(m.role)
        if role is None:
            raise bad_request(
                f"messages[{i}].role {m.role!r} is not supported; use one of "
                f"{', '.join(ROLES)}", "messages")
        content = m.content
        if content is None:
            if role != "assistant":  # only an assistant turn (its tool calls) may have none
                raise bad_request(f"messages[{i}].content is required for role {m.role!r}",
                                  "messages")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content[{j}] has type {part.type!r}; only text parts "
                        "({\"type\": \"text\", \"text\": ...}) are supported", "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = _template_tool_calls(m.tool_calls, i)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thought is not None and role == "assistant":
            d["reasoning_content"] = thought  # what reasoning models' templates read
        out.append(d)
    return out


def _template_tool_calls(calls: list[Any], i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates read them: ``arguments`` as an
    object when it is a JSON string (templates serialise it themselves)."""
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must have function.name and "
                              "function.arguments", "messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = decode_json(args, f"messages[{i}].tool_calls[{j}].function.arguments")
            except JSONTextError as e:
                raise bad_request(str(e), "messages") from None
        out.append({**c, "function": {**fn, "arguments": args}})
    return out


def _template_kwargs(tok: Any, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs``: variables for the template (``enable_thinking``), none
    of which may be a parameter of the rendering itself."""
    if not kwargs:
        return {}
    own = set(inspect.signature(tok.apply_chat_template).parameters) | {
        "messages", "conversation", "tools", "documents"}
    taken = sorted(k for k in kwargs if k in own)
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}: they are "
                          "request fields or parameters of the template's rendering",
                          "chat_template_kwargs")
    return kwargs


def _render_chat(state: ServerState, conv: list[dict[str, Any]],
                 add_generation_prompt: bool, tools: list[dict] | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> Prompt:
    tok = state.tokenizer
    extra = _template_kwargs(tok, template_kwargs)
    try:
        text = tok.apply_chat_template(conv, tokenize=False, tools=tools,
                                       chat_template=state.options.chat_template,
                                       add_generation_prompt=add_generation_prompt, **extra)
    except Exception as e:  # template errors (e.g. role order) are the client's to fix
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    return Prompt(tok.encode(text, add_special_tokens=False), text)


def _chat_prompt(state: ServerState, messages: list[ChatMessage] | None,
                 add_generation_prompt: bool, tools: list[dict] | None,
                 template_kwargs: dict[str, Any] | None) -> Prompt:
    return _render_chat(state, messages_to_dicts(messages), add_generation_prompt, tools,
                        template_kwargs)


async def chat_prompt(state: ServerState, messages: list[ChatMessage] | None,
                      add_generation_prompt: bool = True,
                      tools: list[dict] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> Prompt:
    """The templated and tokenized conversation (with ``tools`` for templates that render
    them, and ``template_kwargs``, the request's ``chat_template_kwargs``), prepared off
    the event loop: its cost grows with the number of messages as well as their text."""
    return await state.offload(_chat_prompt, state, messages, add_generation_prompt, tools,
                               template_kwargs)


def truncate_prompts(prompts: list[Prompt], keep: int | None,
                     max_model_len: int) -> list[Prompt]:
    """``truncate_prompt_tokens``: each prompt cut to its last ``keep`` tokens (``-1``:
    ``max_model_len``). A cut prompt keeps no text: an echo shows its tokens decoded."""
    if keep is None:
        return prompts
    if not _is_int(keep) or keep == 0 or keep < -1 or keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens={keep!r} is invalid: must be -1 (the "
                          f"context length) or an integer in [1, {max_model_len}]",
                          "truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    return [p if len(p.token_ids) <= keep else Prompt(p.token_ids[-keep:], None)
            for p in prompts]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def split_prompts(prompt: str | list[Any] | None, name: str = "prompt",
                  ) -> list[str | list[int]]:  # fmt: skip
    """``str | list[str] | list[int] | list[list[int]]`` -> one entry per prompt (errors
    name the field ``name``)."""
    if prompt is None:
        raise bad_request(f"{name} is required", name)
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request(f"{name} must not be an empty list", name)
    if all(isinstance(p, str) for p in prompt):
        items: list[str | list[int]] = list(prompt)
    elif all(_is_int(t) for t in prompt):
        items = [list(prompt)]
    elif all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
        items = [list(p) for p in prompt]
    else:
        raise bad_request(
            f"{name} must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids", name)
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", name)
    return items


def _encode_all(state: ServerState, items: list[str | list[int]],
                route: Route = COMPLETIONS) -> list[Prompt]:  # fmt: skip
    tok = state.tokenizer
    out = []
    for p in items:
        if isinstance(p, str):
            out.append(Prompt(tok.encode(p), p))
        else:
            state.check_token_ids(p, route)
            out.append(Prompt(p, None))
    return out


def _completion_prompts(state: ServerState, prompt: str | list[Any] | None,
                        route: Route) -> list[Prompt]:  # fmt: skip
    return _encode_all(state, split_prompts(prompt, route.prompt), route)


async def completion_prompts(state: ServerState, prompt: str | list[Any] | None,
                             route: Route = COMPLETIONS) -> list[Prompt]:  # fmt: skip
    """Tokenized completion prompts (token-id prompts are type- and range-checked), off
    the event loop; errors name ``route``'s prompt field."""
    return await state.offload(_completion_prompts, state, prompt, route)


def _echo_texts(state: ServerState, prompts: list[Prompt], decoded: bool) -> list[str]:
    return [p.text if p.text is not None and not decoded
            else state.tokenizer.decode(p.token_ids) for p in prompts]


async def echo_texts(state: ServerState, prompts: list[Prompt], decoded: bool = False,
                     ) -> list[str]:  # fmt: skip
    """The text of each prompt, as ``echo`` repeats it (token-id prompts decoded off the
    event loop). ``decoded``: every prompt's tokens decoded (special tokens kept), the
    text that logprobs' tokens spell and their ``text_offset`` indexes (a tokenizer may
    add a BOS token, or not give a text back exactly as it was sent)."""
    return await state.offload(_echo_texts, state, prompts, decoded)
