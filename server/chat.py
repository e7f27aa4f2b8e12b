"""``POST /v1/chat/completions``: streamed (SSE) and whole responses."""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from engine import TokenLogprobs
from server.errors import APIError
from server.generation import (
    ChoiceTally,
    Generation,
    choice_updates,
    random_id,
    usage_dict,
    with_finish,
)
from server.logprobs import chat_logprobs
from server.params import chat_params
from server.prompts import chat_prompt
from server.protocol import ChatCompletionRequest, read_request
from server.sse import DONE, event, json_response, open_stream, send_error_and_done
from server.state import STATE_KEY, ServerState


@dataclass(slots=True)
class _Ctx:
    id: str
    created: int
    model: str
    n: int
    prompt_tokens: int
    want_logprobs: bool
    include_usage: bool


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    arrival = time.monotonic()
    req = await read_request(request, ChatCompletionRequest)
    model = state.check_model(req.model)
    params, route = chat_params(req)
    state.check_sampling_token_ids(params, route)
    state.admit()
    prompt = await chat_prompt(state, req.messages, req.add_generation_prompt is not False)
    state.fit(len(prompt.token_ids), params, route)
    ctx = _Ctx(
        id=f"chatcmpl-{random_id()}", created=int(time.time()), model=model, n=params.n,
        prompt_tokens=len(prompt.token_ids), want_logprobs=bool(req.logprobs),
        include_usage=bool(req.stream_options and req.stream_options.include_usage))
    async with Generation(state, [prompt], params, route, arrival) as gen:
        if req.stream:
            return await _stream(request, state, gen, ctx)
        return await _whole(state, gen, ctx)


def _chunk(ctx: _Ctx, choices: list[dict], usage: dict | None = None) -> bytes:
    obj = {"id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created,
           "model": ctx.model, "choices": choices}
    if ctx.include_usage:
        obj["usage"] = usage
    return event(obj)


def _lp(state: ServerState, ctx: _Ctx, entries: list[TokenLogprobs] | None) -> dict | None:
    if not ctx.want_logprobs or entries is None:
        return None
    return {"content": chat_logprobs(entries, state.token_piece)}


async def _stream(request: web.Request, state: ServerState, gen: Generation,
                  ctx: _Ctx) -> web.StreamResponse:
    resp = await open_stream(request)
    await resp.write(b"".join(
        _chunk(ctx, [{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
        for i in range(ctx.n)))
    tally = ChoiceTally()
    try:
        async for updates in choice_updates(gen, ctx.n, tally):
            frames = []
            for i, c in updates:
                has_lp = ctx.want_logprobs and bool(c.logprobs)
                if not c.text and c.finish_reason is None and not has_lp:
                    continue  # nothing new to show (text held back by a possible stop string)
                frames.append(_chunk(ctx, [with_finish({
                    "index": i, "delta": {"content": c.text} if c.text or has_lp else {},
                    "logprobs": _lp(state, ctx, c.logprobs) if has_lp else None}, c)]))
            if frames:
                await resp.write(b"".join(frames))
        if ctx.include_usage:
            await resp.write(_chunk(ctx, [], usage_dict(
                ctx.prompt_tokens, tally.completion_tokens, tally.cached_tokens)))
        await resp.write(DONE)
    except APIError as err:
        await send_error_and_done(resp, err)
    except ConnectionResetError:
        pass  # the client went away; leaving the Generation aborts the request
    return resp


async def _whole(state: ServerState, gen: Generation, ctx: _Ctx) -> web.Response:
    texts: list[list[str]] = [[] for _ in range(ctx.n)]
    lps: list[list[TokenLogprobs]] = [[] for _ in range(ctx.n)]
    reasons: list[str | None] = [None] * ctx.n
    stop_reasons: list[int | str | None] = [None] * ctx.n
    tally = ChoiceTally()
    async for updates in choice_updates(gen, ctx.n, tally):
        for i, c in updates:
            texts[i].append(c.text)
            if c.logprobs:
                lps[i].extend(c.logprobs)
            reasons[i] = c.finish_reason
            stop_reasons[i] = c.stop_reason
    choices = [{"index": i,
                "message": {"role": "assistant", "content": "".join(texts[i])},
                "logprobs": _lp(state, ctx, lps[i]),
                "finish_reason": reasons[i],
                "stop_reason": stop_reasons[i]} for i in range(ctx.n)]
    return json_response({
        "id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
        "choices": choices,
        "usage": usage_dict(ctx.prompt_tokens, tally.completion_tokens, tally.cached_tokens)})
