"""``POST /v1/completions``: every prompt is its own set of ``n`` choices.

Choice ``index`` = ``prompt_index * n + i``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from server.errors import APIError
from server.generation import (
    ChoiceTally,
    Generation,
    Prompt,
    choice_updates,
    random_id,
    usage_dict,
    with_finish,
)
from server.logprobs import CompletionLogprobs, merge_completion_logprobs
from server.param_names import COMPLETIONS
from server.params import completion_params
from server.prompts import completion_prompts, echo_texts
from server.protocol import CompletionRequest, read_request
from server.sse import DONE, event, json_response, open_stream, send_error_and_done
from server.state import STATE_KEY, ServerState
from server.structured import check_compiles, request_constraint


@dataclass(slots=True)
class _Ctx:
    id: str
    created: int
    model: str
    n: int
    prompts: list[Prompt]
    echo_texts: list[str] | None
    want_logprobs: bool
    include_usage: bool

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    arrival = time.monotonic()
    req = await read_request(request, CompletionRequest)
    model = state.check_model(req.model)
    constraint = request_constraint(req)
    if constraint is not None:
        await check_compiles(state, constraint)
    params = completion_params(req, constraint and constraint.spec)
    state.check_sampling_token_ids(params, COMPLETIONS)
    state.admit()
    prompts = await completion_prompts(state, req.prompt)
    for p in prompts:
        state.fit(len(p.token_ids), params, COMPLETIONS)
    echo = await echo_texts(state, prompts) if req.echo else None
    ctx = _Ctx(
        id=f"cmpl-{random_id()}", created=int(time.time()), model=model, n=params.n,
        prompts=prompts, echo_texts=echo, want_logprobs=req.logprobs is not None,
        include_usage=bool(req.stream_options and req.stream_options.include_usage))
    async with Generation(state, prompts, params, COMPLETIONS, arrival) as gen:
        if req.stream:
            return await _stream(request, state, gen, ctx)
        return await _whole(state, gen, ctx)


def _chunk(ctx: _Ctx, choices: list[dict], usage: dict | None = None) -> bytes:
    obj = {"id": ctx.id, "object": "text_completion", "created": ctx.created,
           "model": ctx.model, "choices": choices}
    if ctx.include_usage:
        obj["usage"] = usage
    return event(obj)


def _logprob_builders(state: ServerState, ctx: _Ctx) -> list[CompletionLogprobs] | None:
    if not ctx.want_logprobs:
        return None
    return [CompletionLogprobs(
        state.token_piece,
        len(ctx.echo_texts[k // ctx.n]) if ctx.echo_texts else 0)
        for k in range(ctx.num_choices)]


def _usage(ctx: _Ctx, tally: ChoiceTally) -> dict:
    return usage_dict(sum(len(p.token_ids) for p in ctx.prompts), tally.completion_tokens,
                      tally.cached_tokens)


async def _stream(request: web.Request, state: ServerState, gen: Generation,
                  ctx: _Ctx) -> web.StreamResponse:
    resp = await open_stream(request)
    builders = _logprob_builders(state, ctx)
    tally = ChoiceTally()
    try:
        if ctx.echo_texts:
            await resp.write(b"".join(
                _chunk(ctx, [{"index": k, "text": ctx.echo_texts[k // ctx.n],
                              "logprobs": None, "finish_reason": None}])
                for k in range(ctx.num_choices)))
        async for updates in choice_updates(gen, ctx.n, tally):
            frames = []
            for k, c in updates:
                has_lp = builders is not None and bool(c.logprobs)
                if not c.text and c.finish_reason is None and not has_lp:
                    continue
                frames.append(_chunk(ctx, [with_finish({
                    "index": k, "text": c.text,
                    "logprobs": builders[k].build(c.logprobs) if has_lp else None}, c)]))
            if frames:
                await resp.write(b"".join(frames))
        if ctx.include_usage:
            await resp.write(_chunk(ctx, [], _usage(ctx, tally)))
        await resp.write(DONE)
    except APIError as err:
        await send_error_and_done(resp, err)
    except ConnectionResetError:
        pass  # the client went away; leaving the Generation aborts the request
    return resp


async def _whole(state: ServerState, gen: Generation, ctx: _Ctx) -> web.Response:
    m = ctx.num_choices
    texts: list[list[str]] = [[ctx.echo_texts[k // ctx.n]] if ctx.echo_texts else []
                              for k in range(m)]
    builders = _logprob_builders(state, ctx)
    lps: list[list[dict]] = [[] for _ in range(m)]
    reasons: list[str | None] = [None] * m
    stop_reasons: list[int | str | None] = [None] * m
    tally = ChoiceTally()
    async for updates in choice_updates(gen, ctx.n, tally):
        for k, c in updates:
            texts[k].append(c.text)
            if builders is not None and c.logprobs:
                lps[k].append(builders[k].build(c.logprobs))
            reasons[k] = c.finish_reason
            stop_reasons[k] = c.stop_reason
    choices = [{"index": k, "text": "".join(texts[k]),
                "logprobs": merge_completion_logprobs(lps[k]) if builders is not None else None,
                "finish_reason": reasons[k], "stop_reason": stop_reasons[k]}
               for k in range(m)]
    return json_response({
        "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
        "choices": choices, "usage": _usage(ctx, tally)})
