"""``POST /v1/embeddings``: the embedding of each input, as ``client.embeddings.create``
reads it.

Every input (a string, a list of strings, token ids or lists of token ids) is an engine
request with no output tokens whose prompt's final hidden states are pooled
(:mod:`pagedserve.engine.core.pooling`: the model's sentence-transformers pooling, else the last
token's, L2-normalized); they batch with generation on the same engine. ``dimensions``
keeps the first values (then normalizes); ``encoding_format: "base64"`` (the OpenAI SDK's
default) sends each vector as little-endian float32 bytes in base64.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from aiohttp import web

from pagedserve import EngineInputError, LoRARequest, PoolingParams
from pagedserve.server.errors import bad_request
from pagedserve.server.generation import Generation, raise_if_failed
from pagedserve.server.param_names import Route, input_error
from pagedserve.server.params import embedding_params
from pagedserve.server.prompts import completion_prompts, truncate_prompts
from pagedserve.server.protocol import EmbeddingRequest, read_request
from pagedserve.server.sse import json_response
from pagedserve.server.state import STATE_KEY, ServerState

EMBEDDINGS = Route(prompt="input")
ENCODINGS = ("float", "base64")


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    arrival = time.monotonic()
    req = await read_request(request, EmbeddingRequest)
    model, lora = state.resolve_model(req.model)
    fmt = req.encoding_format or "float"
    if fmt not in ENCODINGS:
        raise bad_request(f"encoding_format={fmt!r} is invalid: must be one of {ENCODINGS}",
                          "encoding_format")
    pooling = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    try:  # the engine checks it too; a bad one is a 400 before any work
        pooling.resolved(state.info.pooling_defaults, state.info.limits.hidden_size)
    except EngineInputError as e:
        raise input_error(e, EMBEDDINGS) from None
    vectors, num_tokens = await embed(state, req.input, EMBEDDINGS, lora, pooling,
                                      req.truncate_prompt_tokens, req.priority, arrival)
    return json_response({
        "object": "list", "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def embed(state: ServerState, inputs: Any, route: Route, lora: LoRARequest | None,
                pooling: PoolingParams, truncate: int | None, priority: int,
                arrival: float) -> tuple[list[list[float]], int]:  # fmt: skip
    """The embedding of each input (``inputs`` as completions' ``prompt``; errors name
    ``route``'s field), in order, and the prompt tokens they took."""
    params = embedding_params(priority, route)
    prompts = truncate_prompts(await completion_prompts(state, inputs, route), truncate,
                               state.max_model_len)
    for p in prompts:
        state.fit(len(p.token_ids), params, route)
    vectors: list[list[float]] = [[] for _ in prompts]
    async with Generation(state, prompts, params, route, arrival, lora, pooling) as gen:
        async for i, out in gen:
            if out.finished:
                raise_if_failed(out.outputs[0].finish_reason)
                vectors[i] = out.embedding
    return vectors, sum(len(p.token_ids) for p in prompts)


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
