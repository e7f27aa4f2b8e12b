"""Stored responses of ``/v1/responses``: ``previous_response_id`` continues one, and
``GET``/``DELETE /v1/responses/{id}`` read and remove one.

A response is stored when its request leaves ``store`` unset or true (OpenAI's default),
with the conversation it ends as input items: the items it continued, its own input and
its output (``reasoning``, ``message``, ``function_call``). A request naming it as
``previous_response_id`` has those items before its own input; ``instructions`` are not
carried over, as in OpenAI's API. The store is in memory and bounded
(``--max-stored-responses``, least recently used first out); ``0`` stores nothing.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedserve.server.errors import not_found


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object as it was returned."""
    input: list[dict[str, Any]]
    """The input items it answered (the conversation it continued first), each with an
    ``id``."""

    @property
    def items(self) -> list[dict[str, Any]]:
        """The conversation it ends, as input items: its input, then its output."""
        return [*self.input, *self.response["output"]]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep ``response`` with the input ``items`` it answered (an item sent without
        an id, or with one an earlier item has, gets a fresh one)."""
        seen: set[str] = set()
        stored = []
        for item in items:
            item = _with_id(item, item.get("id") in seen)
            seen.add(item["id"])
            stored.append(item)
        self._items[response["id"]] = StoredResponse(response, stored)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response; a 404 naming ``param`` when there is none."""
        stored = self._items.get(response_id)
        if stored is None:
            raise not_found(f"Response with id '{response_id}' not found.", "response_id")
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]

    def __len__(self) -> int:
        return len(self._items)


def _with_id(item: dict[str, Any], fresh: bool = False) -> dict[str, Any]:
    """An input item as the API lists it: with an ``id`` (a new one if it has none or
    ``fresh``); a message's string content as one text part."""
    kind = item.get("type", "message")
    out = {"id": f"{_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}", "type": kind, **item}
    if fresh:
        out["id"] = f"{_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}"
    content = item.get("content")
    if kind == "message" and isinstance(content, str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": content}]
    return out


_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
           "reasoning": "rs"}  # fmt: skip


def input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value or [])
