"""Small endpoints: models, health, metrics, version, tokenize, detokenize."""

from __future__ import annotations

from aiohttp import web

from pagedserve import __version__
from pagedserve.engine.errors import JSONTextError
from pagedserve.engine.jsonlimits import decode_json
from pagedserve.engine.lora import LoRAError
from pagedserve.engine.lora.request import check_lora_name
from pagedserve.server.errors import bad_request, not_found
from pagedserve.server.lora import LoRAModule, LoRANameError
from pagedserve.server.metrics import CONTENT_TYPE
from pagedserve.server.param_names import DETOKENIZE
from pagedserve.server.prompts import chat_prompt
from pagedserve.server.protocol import DetokenizeRequest, TokenizeRequest, read_request
from pagedserve.server.sse import json_response, read_json
from pagedserve.server.state import STATE_KEY, ServerState


def _card(state: ServerState, name: str) -> dict:
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "pagedserve",
            "root": state.info.model_name, "parent": None, "max_model_len": state.max_model_len}
    if state.loras.get(name) is not None:
        card.update(state.loras.card(name))
    return card


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    names = [*state.model_names, *state.loras.by_name]
    return json_response({"object": "list", "data": [_card(state, name) for name in names]})


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


async def load_adapter(request: web.Request) -> web.Response:
    """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``. The adapter's files are
    read and checked on the tokenizer thread, so a large or slow one stalls no other
    request."""
    state = request.app[STATE_KEY]
    body = await _lora_body(request, ("lora_name", "lora_path"))
    module = LoRAModule(body["lora_name"], body["lora_path"])
    try:
        state.loras.check_name(module.name)  # before any file is read
        await state.offload(state.loras.check, module)
        state.loras.register(module)
    except LoRAError as e:
        raise bad_request(str(e), "lora_name" if isinstance(e, LoRANameError) else
                          "lora_path") from None  # fmt: skip
    return web.Response(text=f"Success: LoRA adapter '{module.name}' added successfully.")


async def unload_adapter(request: web.Request) -> web.Response:
    """``POST /v1/unload_lora_adapter {"lora_name"}``: new requests may no longer name it
    (running ones finish with it)."""
    state = request.app[STATE_KEY]
    name = (await _lora_body(request, ("lora_name",)))["lora_name"]
    try:
        check_lora_name(name)
    except LoRAError as e:
        raise bad_request(str(e), "lora_name") from None
    removed = state.loras.remove(name)
    if removed is None:
        raise not_found(f"The LoRA adapter `{name}` is not served.", "lora_name")
    state.engine.retire_lora(removed.lora_int_id)  # its weights go once no request uses it
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _lora_body(request: web.Request, keys: tuple[str, ...]) -> dict:
    try:
        body = decode_json(await read_json(request), "the request body")
    except JSONTextError as e:
        raise bad_request(str(e), None) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    for k in keys:
        if not isinstance(body.get(k), str) or not body[k]:
            raise bad_request(f"{k} must be a non-empty string", k)
    return body
