"""Small endpoints: models, health, metrics, version, tokenize, detokenize."""

from __future__ import annotations

from aiohttp import web

from engine import __version__
from server.errors import bad_request
from server.metrics import CONTENT_TYPE
from server.param_names import DETOKENIZE
from server.prompts import chat_prompt
from server.protocol import DetokenizeRequest, TokenizeRequest, read_request
from server.sse import json_response
from server.state import STATE_KEY, ServerState


def _card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "pagedserve",
            "root": state.info.model_name, "max_model_len": state.max_model_len}


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return json_response({"object": "list",
                          "data": [_card(state, name) for name in state.model_names]})


async def model(request: web.Request) -> web.Response:
    """One served model's card (``client.models.retrieve``); an unknown name is a 404
    naming ``model``."""
    state = request.app[STATE_KEY]
    return json_response(_card(state, state.check_model(request.match_info["model"])))


async def health(request: web.Request) -> web.Response:
    """200 with an empty body while the engine thread is alive and progressing; else 503."""
    state = request.app[STATE_KEY]
    return web.Response(status=200 if state.engine.is_healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


async def tokenize(request: web.Request) -> web.Response:
    """``{prompt}`` or ``{messages}`` -> ``{count, max_model_len, tokens}``."""
    state = request.app[STATE_KEY]
    req = await read_request(request, TokenizeRequest)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        ids = (await chat_prompt(state, req.messages, req.add_generation_prompt is not False,
                                 template_kwargs=req.chat_template_kwargs)).token_ids
    else:
        ids = await state.offload(state.tokenizer.encode, req.prompt,
                                  add_special_tokens=req.add_special_tokens is not False)
    return json_response({"count": len(ids), "max_model_len": state.max_model_len,
                          "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    """``{tokens}`` -> ``{prompt}``."""
    state = request.app[STATE_KEY]
    req = await read_request(request, DetokenizeRequest)
    state.check_model(req.model)
    text = await state.offload(_detokenize, state, req.tokens)
    return json_response({"prompt": text})


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    # One decode call holds the GIL throughout: bounded by the context length.
    if len(tokens) > state.max_model_len:
        raise bad_request(f"tokens may have at most max_model_len={state.max_model_len} "
                          f"entries, got {len(tokens)}", "tokens")
    state.check_token_ids(tokens, DETOKENIZE)
    return state.tokenizer.decode(tokens)
