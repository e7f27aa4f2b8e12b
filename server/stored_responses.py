"""``GET /v1/responses/{response_id}``, its ``/input_items`` and ``DELETE``: the stored
responses of :mod:`pagedserve.server.responses_store`, as ``client.responses.retrieve``,
``client.responses.input_items.list`` and ``client.responses.delete`` read them."""

from __future__ import annotations

from aiohttp import web

from pagedserve.server.errors import bad_request
from pagedserve.server.sse import json_response
from pagedserve.server.state import STATE_KEY


async def retrieve_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}``: a stored response."""
    store = request.app[STATE_KEY].responses
    return json_response(store.get(request.match_info["response_id"]).response)


async def list_input_items(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}/input_items`` (``limit`` 1-100, default 20;
    ``order`` desc or asc; ``after``/``before`` an item id): a page of the input items a
    stored response answered."""
    items = request.app[STATE_KEY].responses.get(request.match_info["response_id"]).input
    q = request.query
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order={order!r} is invalid: must be 'asc' or 'desc'", "order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request(f"limit={q.get('limit')!r} is invalid: must be an integer in "
                          "[1, 100]", "limit")
    items = items[::-1] if order == "desc" else items
    ids = [x["id"] for x in items]
    for key in ("after", "before"):
        if key in q and q[key] not in ids:
            raise bad_request(f"{key}={q[key]!r} is not an item of this response", key)
    lo = ids.index(q["after"]) + 1 if "after" in q else 0
    hi = ids.index(q["before"]) if "before" in q else len(items)
    if "before" in q and "after" not in q:  # the page just before it
        start = max(lo, hi - limit)
        page, more = items[start:hi], start > lo
    else:  # the page from ``after`` on
        page = items[lo:min(hi, lo + limit)]
        more = lo + len(page) < hi
    return json_response({"object": "list", "data": page,
                          "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": more})


async def delete_response(request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{response_id}``."""
    rid = request.match_info["response_id"]
    request.app[STATE_KEY].responses.delete(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})
