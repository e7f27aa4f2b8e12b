"""``POST /v1/completions``: every prompt is its own set of ``n`` choices.

Choice ``index`` = ``prompt_index * n + i``. With ``echo`` a choice's text begins with its
prompt, and with ``logprobs`` too its logprobs begin with the prompt's tokens (the first
has none) and the echoed prompt is those tokens decoded (what the offsets index);
``echo`` with ``max_tokens=0`` gives the prompt back and generates nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import web

from pagedserve.server.errors import APIError
from pagedserve.server.generation import (
    ChoiceTally,
    Generation,
    Prompt,
    choice_updates,
    random_id,
    usage_dict,
    with_finish,
)
from pagedserve.server.logprobs import (
    CompletionLogprobs,
    TokenPieces,
    merge_completion_logprobs,
    prompt_logprobs_json,
)
from pagedserve.server.param_names import COMPLETIONS
from pagedserve.server.params import completion_params
from pagedserve.server.prompts import completion_prompts, echo_texts, truncate_prompts
from pagedserve.server.protocol import CompletionRequest, read_request
from pagedserve.server.sse import DONE, event, json_response, open_stream, send_error_and_done
from pagedserve.server.state import STATE_KEY, ServerState
from pagedserve.server.structured import check_compiles, request_constraint


@dataclass(slots=True)
class _Ctx:
    id: str
    created: int
    model: str
    n: int
    prompts: list[Prompt]
    echo_texts: list[str] | None
    want_logprobs: bool
    want_prompt_logprobs: bool
    include_usage: bool
    pieces: TokenPieces
    """How logprobs name tokens (``ServerState.pieces``)."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats``: every chunk carries the usage so far."""
    usage_now: dict | None = None
    token_ids: bool = False
    """``return_token_ids``: each choice carries its prompt's ids and its token ids."""

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    arrival = time.monotonic()
    req = await read_request(request, CompletionRequest)
    model, lora = state.resolve_model(req.model)  # the adapter as of now
    constraint = request_constraint(req)
    if constraint is not None:
        await check_compiles(state, constraint)
    params = completion_params(req, constraint and constraint.spec, state.sampling_defaults)
    state.check_sampling_token_ids(params, COMPLETIONS)
    state.admit()
    prompts = truncate_prompts(await completion_prompts(state, req.prompt),
                               req.truncate_prompt_tokens, state.max_model_len)
    for p in prompts:
        state.fit(len(p.token_ids), params, COMPLETIONS)
    echo = await echo_texts(state, prompts, decoded=req.logprobs is not None) \
        if req.echo else None
    ctx = _Ctx(
        id=f"cmpl-{random_id()}", created=int(time.time()), model=model, n=params.n,
        prompts=prompts, echo_texts=echo,
        want_logprobs=req.logprobs is not None,
        want_prompt_logprobs=req.prompt_logprobs is not None,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
        pieces=state.pieces(req.return_tokens_as_token_ids),
        token_ids=bool(req.return_token_ids))
    async with Generation(state, prompts, params, COMPLETIONS, arrival, lora,
                          cache_salt=req.cache_salt) as gen:
        if req.stream:
            return await _stream(request, state, gen, ctx)
        return await _whole(state, gen, ctx)


def _chunk(ctx: _Ctx, choices: list[dict], usage: dict | None = None) -> bytes:
    obj = {"id": ctx.id, "object": "text_completion", "created": ctx.created,
           "model": ctx.model, "choices": choices}
    if ctx.include_usage:
        obj["usage"] = usage if usage is not None or not ctx.continuous_usage else ctx.usage_now
    return event(obj)


def _logprob_builders(ctx: _Ctx) -> list[CompletionLogprobs] | None:
    if not ctx.want_logprobs:
        return None
    return [CompletionLogprobs(
        ctx.pieces,
        len(ctx.echo_texts[k // ctx.n]) if ctx.echo_texts else 0)
        for k in range(ctx.num_choices)]


def _usage(ctx: _Ctx, tally: ChoiceTally) -> dict:
    return usage_dict(sum(len(p.token_ids) for p in ctx.prompts), tally.completion_tokens,
                      tally.cached_tokens)


def _prompt_logprobs(ctx: _Ctx, tally: ChoiceTally, builders: list[CompletionLogprobs],
                     pidx: int) -> dict:
    """The echoed prompt's logprob columns (the same for each of its ``n`` choices)."""
    return builders[pidx * ctx.n].build_prompt(ctx.prompts[pidx].token_ids[0],
                                               tally.prompt_logprobs[pidx][1:])


async def _stream(request: web.Request, state: ServerState, gen: Generation,
                  ctx: _Ctx) -> web.StreamResponse:
    resp = await open_stream(request)
    builders = _logprob_builders(ctx)
    tally = ChoiceTally()
    ctx.usage_now = _usage(ctx, tally)
    # Echo with logprobs: a prompt's echo goes out with its logprobs once they are in
    # (held: what its choices produce before that; the first sibling computes the prompt
    # before the others are admitted, so this is a guard).
    held: dict[int, list[bytes]] | None = None
    # return_token_ids: the token ids of deltas not sent (their text held back by a
    # possible stop string), and the choices whose prompt ids went out (with the echo).
    held_ids: dict[int, list[int]] = {}
    sent = set(range(ctx.num_choices)) if ctx.echo_texts else set()
    try:
        if ctx.echo_texts and builders is not None:
            held = {p: [] for p in range(len(ctx.prompts))}
        elif ctx.echo_texts:
            await resp.write(b"".join(_echo_chunks(ctx, range(len(ctx.prompts)))))
        async for updates in choice_updates(gen, ctx.n, tally):
            frames = []
            if ctx.continuous_usage:
                ctx.usage_now = _usage(ctx, tally)
            if held is not None:
                for pidx in sorted(held.keys() & tally.prompt_logprobs.keys()):
                    frames += _echo_chunks(ctx, [pidx],
                                           _prompt_logprobs(ctx, tally, builders, pidx))
                    frames += held.pop(pidx)
            for k, c in updates:
                has_lp = builders is not None and bool(c.logprobs)
                if not c.text and c.finish_reason is None and not has_lp:
                    if ctx.token_ids:
                        held_ids.setdefault(k, []).extend(c.token_ids)
                    continue
                choice = with_finish({
                    "index": k, "text": c.text,
                    "logprobs": builders[k].build(c.logprobs) if has_lp else None}, c)
                if ctx.token_ids:
                    if k not in sent:
                        sent.add(k)
                        choice["prompt_token_ids"] = ctx.prompts[k // ctx.n].token_ids
                    choice["token_ids"] = held_ids.pop(k, []) + list(c.token_ids)
                frame = _chunk(ctx, [choice])
                (held[k // ctx.n] if held and k // ctx.n in held else frames).append(frame)
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


def _echo_chunks(ctx: _Ctx, prompt_indices: Iterable[int],
                 logprobs: dict | None = None) -> list[bytes]:
    ids = (lambda p: {"prompt_token_ids": ctx.prompts[p].token_ids, "token_ids": []}) \
        if ctx.token_ids else (lambda p: {})  # fmt: skip
    return [_chunk(ctx, [{"index": p * ctx.n + i, "text": ctx.echo_texts[p],
                          "logprobs": logprobs, "finish_reason": None, **ids(p)}])
            for p in prompt_indices for i in range(ctx.n)]


async def _whole(state: ServerState, gen: Generation, ctx: _Ctx) -> web.Response:
    m = ctx.num_choices
    texts: list[list[str]] = [[ctx.echo_texts[k // ctx.n]] if ctx.echo_texts else []
                              for k in range(m)]
    builders = _logprob_builders(ctx)
    lps: list[list[dict]] = [[] for _ in range(m)]
    ids: list[list[int]] = [[] for _ in range(m)]
    reasons: list[str | None] = [None] * m
    stop_reasons: list[int | str | None] = [None] * m
    tally = ChoiceTally()
    async for updates in choice_updates(gen, ctx.n, tally):
        for k, c in updates:
            texts[k].append(c.text)
            if builders is not None and c.logprobs:
                lps[k].append(builders[k].build(c.logprobs))
            ids[k] += c.token_ids
            reasons[k] = c.finish_reason
            stop_reasons[k] = c.stop_reason
    if builders is not None and ctx.echo_texts:
        cols = [_prompt_logprobs(ctx, tally, builders, p) for p in range(len(ctx.prompts))]
        for k in range(m):
            lps[k].insert(0, cols[k // ctx.n])
    choices = [{"index": k, "text": "".join(texts[k]),
                "logprobs": merge_completion_logprobs(lps[k]) if builders is not None else None,
                "finish_reason": reasons[k], "stop_reason": stop_reasons[k]}
               for k in range(m)]
    if ctx.want_prompt_logprobs:
        per_prompt = [prompt_logprobs_json(tally.prompt_logprobs[p])
                      for p in range(len(ctx.prompts))]
        for k, choice in enumerate(choices):
            choice["prompt_logprobs"] = per_prompt[k // ctx.n]
    if ctx.token_ids:
        for k, choice in enumerate(choices):
            choice["prompt_token_ids"] = ctx.prompts[k // ctx.n].token_ids
            choice["token_ids"] = ids[k]
    return json_response({
        "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
        "choices": choices, "usage": _usage(ctx, tally)})
