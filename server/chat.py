"""``POST /v1/chat/completions``: streamed (SSE) and whole responses."""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from pagedserve import TokenLogprobs
from pagedserve.server.errors import APIError
from pagedserve.server.generation import (
    ChoiceTally,
    Generation,
    choice_updates,
    random_id,
    usage_dict,
    with_finish,
)
from pagedserve.server.logprobs import TokenPieces, chat_logprobs, prompt_logprobs_json
from pagedserve.server.params import chat_params
from pagedserve.server.prompts import chat_prompt, truncate_prompts
from pagedserve.server.protocol import ChatCompletionRequest, read_request
from pagedserve.server.reasoning import ReasoningParser, gate_after_reasoning
from pagedserve.server.sse import DONE, event, json_response, open_stream, send_error_and_done
from pagedserve.server.state import STATE_KEY, ServerState
from pagedserve.server.structured import check_compiles, request_constraint
from pagedserve.server.tool_parser import ToolCallParser
from pagedserve.server.tools import ToolPlan, tool_plan, with_tool_constraint


@dataclass(slots=True)
class _Ctx:
    id: str
    created: int
    model: str
    n: int
    prompt_tokens: int
    want_logprobs: bool
    want_prompt_logprobs: bool
    include_usage: bool
    tools: ToolPlan
    pieces: TokenPieces
    """How logprobs name tokens (``ServerState.pieces``)."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats``: every chunk carries the usage so far."""
    usage_now: dict | None = None
    reasoning_parser: str | None = None
    include_reasoning: bool = True
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    """``return_token_ids``: the prompt's ids, and each choice's token ids, go out too."""

    def parsers(self) -> list[ChoiceParser]:
        """One parser per choice."""
        t = self.tools
        return [ChoiceParser(
            None if self.reasoning_parser is None
            else ReasoningParser(self.reasoning_parser, self.prompt_text),
            None if t.parser is None else ToolCallParser(t.parser, t.function_name))
            for _ in range(self.n)]


@dataclass(slots=True)
class ChoiceParser:
    """A choice's text split into reasoning, content and tool calls: the reasoning
    parser first (when the server has one), then the tool-call parser on the content."""

    reasoning: ReasoningParser | None
    tools: ToolCallParser | None
    thought: str = ""
    """All the reasoning so far."""
    content: str = ""
    """All the content so far."""
    reasoning_tokens: int = 0
    """Tokens of the steps whose text was (or ended) inside the reasoning."""

    def feed(self, text: str, final: bool, num_tokens: int = 0
             ) -> tuple[str, str, list[dict]]:  # fmt: skip
        """The new ``(reasoning, content, delta.tool_calls entries)`` of a step's
        ``text`` (``num_tokens`` tokens)."""
        rp = self.reasoning
        before = rp is not None and rp.in_reasoning
        thought, content = ("", text) if rp is None else rp.feed(text, final)
        if before or (rp is not None and rp.in_reasoning):
            self.reasoning_tokens += num_tokens
        calls: list[dict] = []
        # No call before the answer starts: a named call would be announced at once.
        if self.tools is not None and (content or (final and self.tools.text)):
            content, calls = self.tools.feed(content, final)
        self.thought += thought
        self.content += content
        return thought, content, calls

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    arrival = time.monotonic()
    req = await read_request(request, ChatCompletionRequest)
    model, lora = state.resolve_model(req.model)  # the adapter as of now
    tools = tool_plan(req, state.options)
    constraint = with_tool_constraint(request_constraint(req), tools, req.tool_choice)
    if constraint is not None:
        await check_compiles(state, constraint)
    params, route = chat_params(req, constraint and constraint.spec, state.sampling_defaults)
    state.check_sampling_token_ids(params, route)
    state.admit()
    prompt = await chat_prompt(state, req.messages, req.add_generation_prompt is not False,
                               tools.tools, req.chat_template_kwargs)
    rendered = prompt.text  # where a reasoning parser looks: its end survives a cut
    gate_after_reasoning(params, state.tokenizer, state.options.reasoning_parser, rendered)
    prompt = truncate_prompts([prompt], req.truncate_prompt_tokens, state.max_model_len)[0]
    state.fit(len(prompt.token_ids), params, route)
    ctx = _Ctx(
        id=f"chatcmpl-{random_id()}", created=int(time.time()), model=model, n=params.n,
        prompt_tokens=len(prompt.token_ids), want_logprobs=bool(req.logprobs),
        want_prompt_logprobs=req.prompt_logprobs is not None,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
        tools=tools, reasoning_parser=state.options.reasoning_parser,
        include_reasoning=req.include_reasoning is not False, prompt_text=rendered,
        pieces=state.pieces(req.return_tokens_as_token_ids),
        prompt_ids=prompt.token_ids if req.return_token_ids else None)
    async with Generation(state, [prompt], params, route, arrival, lora,
                          cache_salt=req.cache_salt) as gen:
        if req.stream:
            return await _stream(request, state, gen, ctx)
        return await _whole(state, gen, ctx)


def _chunk(ctx: _Ctx, choices: list[dict], usage: dict | None = None,
           first: bool = False) -> bytes:
    obj = {"id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created,
           "model": ctx.model, "choices": choices}
    if first and ctx.prompt_ids is not None:  # the stream's first chunk alone carries them
        obj["prompt_token_ids"] = ctx.prompt_ids
    if ctx.include_usage:
        obj["usage"] = usage if usage is not None or not ctx.continuous_usage else ctx.usage_now
    return event(obj)


def _lp(ctx: _Ctx, entries: list[TokenLogprobs] | None) -> dict | None:
    if not ctx.want_logprobs or entries is None:
        return None
    return {"content": chat_logprobs(entries, ctx.pieces)}


async def _stream(request: web.Request, state: ServerState, gen: Generation,
                  ctx: _Ctx) -> web.StreamResponse:
    resp = await open_stream(request)
    tally = ChoiceTally()
    parsers = ctx.parsers()
    ctx.usage_now = _usage(ctx, tally, parsers)
    await resp.write(b"".join(
        _chunk(ctx, [{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}], first=i == 0)
        for i in range(ctx.n)))
    held: list[list[int]] = [[] for _ in range(ctx.n)]  # token ids of skipped deltas
    try:
        async for updates in choice_updates(gen, ctx.n, tally):
            choices = []
            for i, c in updates:
                has_lp = ctx.want_logprobs and bool(c.logprobs)
                delta, reason = _delta(ctx, parsers[i], c.text, c.finish_reason,
                                       len(c.token_ids))
                if not delta and reason is None and not has_lp:
                    if ctx.prompt_ids is not None:  # text held back by a possible stop string
                        held[i] += c.token_ids
                    continue
                if has_lp and "content" not in delta:
                    delta["content"] = ""
                choice = with_finish({"index": i, "delta": delta, "logprobs":
                                      _lp(ctx, c.logprobs) if has_lp else None}, c)
                choice["finish_reason"] = reason
                if ctx.prompt_ids is not None:
                    choice["token_ids"], held[i] = held[i] + list(c.token_ids), []
                choices.append(choice)
            if choices:
                ctx.usage_now = _usage(ctx, tally, parsers) if ctx.continuous_usage else None
                await resp.write(b"".join(_chunk(ctx, [ch]) for ch in choices))
        if ctx.include_usage:
            await resp.write(_chunk(ctx, [], _usage(ctx, tally, parsers)))
        await resp.write(DONE)
    except APIError as err:
        await send_error_and_done(resp, err)
    except ConnectionResetError:
        pass  # the client went away; leaving the Generation aborts the request
    return resp


def _usage(ctx: _Ctx, tally: ChoiceTally, parsers: list[ChoiceParser]) -> dict:
    usage = usage_dict(ctx.prompt_tokens, tally.completion_tokens, tally.cached_tokens)
    if ctx.reasoning_parser is not None:
        usage["completion_tokens_details"] = {
            "reasoning_tokens": sum(p.reasoning_tokens for p in parsers)}
    return usage


def _delta(ctx: _Ctx, parser: ChoiceParser, text: str, finish: str | None,
           num_tokens: int) -> tuple[dict, str | None]:
    """A choice's stream delta for new ``text`` (reasoning and tool calls parsed out of
    it) and its finish reason (``tool_calls`` when it made calls and stopped)."""
    thought, content, calls = parser.feed(text, finish is not None, num_tokens)
    delta: dict = {}
    if thought and ctx.include_reasoning:
        delta["reasoning_content"] = delta["reasoning"] = thought
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta, _reason(parser, finish)


def _reason(parser: ChoiceParser, finish: str | None) -> str | None:
    return "tool_calls" if parser.made_calls and finish == "stop" else finish


def _message(ctx: _Ctx, parser: ChoiceParser) -> dict:
    """The whole message of a choice whose text was all fed to ``parser``."""
    thought, content = parser.thought, parser.content
    calls = parser.tools.calls if parser.tools is not None else []
    msg: dict = {"role": "assistant",
                 "content": None if not content and (calls or thought) else content}
    if thought and ctx.include_reasoning:
        msg["reasoning_content"] = msg["reasoning"] = thought
    if calls:
        msg["tool_calls"] = calls
    return msg


async def _whole(state: ServerState, gen: Generation, ctx: _Ctx) -> web.Response:
    parsers = ctx.parsers()
    lps: list[list[TokenLogprobs]] = [[] for _ in range(ctx.n)]
    ids: list[list[int]] = [[] for _ in range(ctx.n)]
    reasons: list[str | None] = [None] * ctx.n
    stop_reasons: list[int | str | None] = [None] * ctx.n
    tally = ChoiceTally()
    async for updates in choice_updates(gen, ctx.n, tally):
        for i, c in updates:
            parsers[i].feed(c.text, c.finish_reason is not None, len(c.token_ids))
            if c.logprobs:
                lps[i].extend(c.logprobs)
            ids[i] += c.token_ids
            reasons[i] = c.finish_reason
            stop_reasons[i] = c.stop_reason
    choices = [{"index": i,
                "message": _message(ctx, parsers[i]),
                "logprobs": _lp(ctx, lps[i]),
                "finish_reason": _reason(parsers[i], reasons[i]),
                "stop_reason": stop_reasons[i]} for i in range(ctx.n)]
    body = {
        "id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
        "choices": choices, "usage": _usage(ctx, tally, parsers)}
    if ctx.prompt_ids is not None:
        body["prompt_token_ids"] = ctx.prompt_ids
        for choice, choice_ids in zip(choices, ids, strict=True):
            choice["token_ids"] = choice_ids
    if ctx.want_prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_json(tally.prompt_logprobs[0])
    return json_response(body)
