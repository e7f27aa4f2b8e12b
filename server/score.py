"""``POST /v1/score`` and ``/v1/rerank`` (also ``/rerank``, ``/v2/rerank``): how alike texts
are, as vLLM serves them for embedding models, from the cosine similarity of their
embeddings (:mod:`pagedserve.server.embeddings`' pooling).

* score: ``text_1`` against ``text_2``; one against many, or pairwise when both are lists
  of the same length. ``data`` holds a ``score`` per pair, in order.
* rerank (the Jina / Cohere API): ``documents`` (strings or ``{"text": ...}``) ordered by
  their relevance to ``query``, the ``top_n`` first (all when unset or not positive, as
  vLLM), each with its ``index`` and ``relevance_score``.
"""

from __future__ import annotations

import math
import time
from typing import Any

from aiohttp import web

from pagedserve import PoolingParams
from pagedserve.server.embeddings import embed
from pagedserve.server.errors import bad_request
from pagedserve.server.generation import random_id
from pagedserve.server.param_names import Route
from pagedserve.server.prompts import MAX_PROMPTS
from pagedserve.server.protocol import RerankRequest, ScoreRequest, read_request
from pagedserve.server.sse import json_response
from pagedserve.server.state import STATE_KEY

SCORE = Route(prompt="text_1")
RERANK = Route(prompt="documents")


async def _embed(request: web.Request, texts: list[str], route: Route, model: str | None,
                 truncate: int | None, priority: int) -> tuple[str, list[list[float]], int]:  # fmt: skip
    """The served name, each text's normalized embedding and the prompt tokens."""
    state = request.app[STATE_KEY]
    arrival = time.monotonic()
    name, lora = state.resolve_model(model)
    vectors, tokens = await embed(state, texts, route, lora, PoolingParams(normalize=True),
                                  truncate, priority, arrival)
    return name, vectors, tokens


def _cosine(a: list[float], b: list[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))  # both are unit vectors


def _texts(value: Any, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t
                                                           for t in texts):  # fmt: skip
        raise bad_request(f"{name} must be a non-empty string or a non-empty list of them",
                          name)
    return texts


async def score(request: web.Request) -> web.Response:
    req = await read_request(request, ScoreRequest)
    left, right = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
    if len(left) != 1 and len(left) != len(right):
        raise bad_request(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one "
                          "text_1, or as many as text_2", "text_2")
    if len(left) + len(right) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} texts per request", "text_2")
    model, vecs, tokens = await _embed(request, [*left, *right], SCORE, req.model,
                                       req.truncate_prompt_tokens, req.priority)  # fmt: skip
    a, b = vecs[:len(left)], vecs[len(left):]
    scores = [_cosine(a[0] if len(a) == 1 else a[i], v) for i, v in enumerate(b)]
    return json_response({
        "id": f"score-{random_id()}", "object": "list", "created": int(time.time()),
        "model": model, "data": [{"index": i, "object": "score", "score": s}
                                 for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(request: web.Request) -> web.Response:
    req = await read_request(request, RerankRequest)
    if not isinstance(req.query, str) or not req.query:
        raise bad_request("query must be a non-empty string", "query")
    docs = _texts([d.get("text") if isinstance(d, dict) else d for d in req.documents]
                  if isinstance(req.documents, list) else req.documents, "documents")
    if len(docs) + 1 > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS - 1} documents per request", "documents")
    top_n = req.top_n if req.top_n is not None and req.top_n > 0 else len(docs)  # as vLLM
    model, vecs, tokens = await _embed(request, [req.query, *docs], RERANK, req.model,
                                       req.truncate_prompt_tokens, req.priority)  # fmt: skip
    scores = [_cosine(vecs[0], v) for v in vecs[1:]]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if req.return_documents is not False
                   else {})} for i in order]  # fmt: skip
    return json_response({"id": f"rerank-{random_id()}", "model": model, "results": results,
                          "usage": {"total_tokens": tokens}})
