"""``POST /v1/responses``: the Responses API over the chat machinery, whole or streamed.

The request becomes a chat request (:mod:`pagedserve.server.responses_input`): the same template,
sampling, tools, constraints and reasoning parser. The output is a list of items: a
``reasoning`` item (with ``--reasoning-parser``), a ``message`` with one ``output_text``
part, and a ``function_call`` item per call. Streamed, each item opens with
``response.output_item.added``, grows by deltas and closes with
``response.output_item.done``, between ``response.created`` / ``response.in_progress``
and ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it);
every event is ``event: <type>`` and ``data: <json>`` with a ``sequence_number``. A
failure after the 200 is a ``response.failed`` event. Asked for, the message's
``output_text`` carries the logprobs of the tokens whose text is in it
(:meth:`_Output._message_logprobs`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from pagedserve.server.chat import ChoiceParser
from pagedserve.server.errors import APIError, bad_request, not_found
from pagedserve.server.generation import ChoiceTally, Generation, Prompt, choice_updates
from pagedserve.server.logprobs import TokenPieces, chat_logprobs
from pagedserve.server.params import chat_params
from pagedserve.server.prompts import chat_prompt, truncate_prompts
from pagedserve.server.protocol import ResponsesRequest, read_request
from pagedserve.server.reasoning import ReasoningParser, gate_after_reasoning
from pagedserve.server.responses_input import (
    RESPONSES,
    chat_request,
    text_constraint,
    wants_logprobs,
)
from pagedserve.server.responses_store import input_items
from pagedserve.server.sse import STREAM_ERROR_KEY, json_response, open_stream, send_error_and_done
from pagedserve.server.state import STATE_KEY
from pagedserve.server.structured import check_compiles, request_constraint
from pagedserve.server.tool_parser import ToolCallParser
from pagedserve.server.tools import tool_plan, with_tool_constraint

_encode = msgspec.json.Encoder().encode


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def responses(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    arrival = time.monotonic()
    req = await read_request(request, ResponsesRequest)
    model, lora = state.resolve_model(req.model)  # the adapter as of now
    if req.truncation not in (None, "auto", "disabled"):
        raise bad_request(f"truncation={req.truncation!r} is invalid: must be 'auto' or "
                          "'disabled'", "truncation")
    conv = _conversation(state, req)
    store = state.responses.enabled and req.store is not False
    chat = chat_request(conv)
    tools = tool_plan(chat, state.options)
    constraint = text_constraint(req)
    other = request_constraint(chat)
    if constraint is not None and other is not None:
        raise bad_request(f"set at most one of text.format and {other.param}", other.param)
    constraint = constraint or other
    constraint = with_tool_constraint(constraint, tools, req.tool_choice)
    if constraint is not None:
        await check_compiles(state, constraint)
    params, _ = chat_params(chat, constraint and constraint.spec, state.sampling_defaults)
    state.check_sampling_token_ids(params, RESPONSES)
    state.admit()
    prompt = await _fit(state, req, conv, tools.tools)  # the whole conversation is stored
    reasoning = state.options.reasoning_parser
    rendered = prompt.text
    gate_after_reasoning(params, state.tokenizer, reasoning, rendered)
    prompt = truncate_prompts([prompt], req.truncate_prompt_tokens, state.max_model_len)[0]
    state.fit(len(prompt.token_ids), params, RESPONSES)
    out = _Output(
        base=_base(req, model, store), input_tokens=len(prompt.token_ids),
        streaming=bool(req.stream),
        pieces=state.token_piece if wants_logprobs(req) else None,
        special=frozenset(state.tokenizer.all_special_ids),
        parser=ChoiceParser(
            None if reasoning is None else ReasoningParser(reasoning, rendered),
            None if tools.parser is None else ToolCallParser(tools.parser, tools.function_name)))
    if store:  # once whole, with the input it answered
        out.on_done = lambda response: state.responses.put(response, input_items(conv.input))
    async with Generation(state, [prompt], params, RESPONSES, arrival, lora, None,
                          chat.cache_salt) as gen:
        if req.stream:
            return await _stream(request, gen, out)
        async for _ in out.run(gen):
            pass
        return json_response(out.response())


async def _render(state, conv: ResponsesRequest, tools: list | None) -> Prompt:
    chat = chat_request(conv)
    try:
        return await chat_prompt(state, chat.messages, True, tools, chat.chat_template_kwargs)
    except APIError as e:  # the template's complaint is about the input items
        raise (bad_request(str(e), "input") if e.param == "messages" else e) from None


async def _fit(state, req: ResponsesRequest, conv: ResponsesRequest,
               tools: list | None) -> Prompt:  # fmt: skip
    """The rendered prompt of ``conv``. With ``truncation: "auto"``, the oldest turns
    of the conversation are dropped until the prompt and ``max_output_tokens`` (at least
    one token) fit the context: it then starts at a user message, the last user message
    and what follows it are never dropped, and system/developer messages stay."""
    prompt = await _render(state, conv, tools)
    room = state.max_model_len - (req.max_output_tokens or 1)
    if req.truncation != "auto" or len(prompt.token_ids) <= room:
        return prompt
    items = input_items(conv.input)
    starts = [i for i, x in enumerate(items) if x.get("type", "message") == "message"
              and x.get("role") == "user"][1:]  # fmt: skip

    def cut(k: int) -> ResponsesRequest:  # the turns before user message ``starts[k]`` go
        kept = [x for x in items[:starts[k]] if x.get("role") in ("system", "developer")]
        return msgspec.structs.replace(conv, input=[*kept, *items[starts[k]:]])

    lo, hi = 0, len(starts)  # binary search: the fewest turns dropped that fit
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = await _render(state, cut(mid), tools)
        if len(candidate.token_ids) <= room:
            hi, best = mid, candidate
        else:
            lo = mid + 1
    return best if lo < len(starts) else prompt


def _conversation(state, req: ResponsesRequest) -> ResponsesRequest:
    """``req`` with the stored conversation it continues (``previous_response_id``)
    before its own input."""
    rid = req.previous_response_id
    if rid is None:
        return req
    if not state.responses.enabled:
        raise bad_request("previous_response_id is not supported: this server stores no "
                          "responses (--max-stored-responses 0); send the whole "
                          "conversation in input", "previous_response_id")
    try:
        prior = state.responses.get(rid).items
    except APIError:
        raise not_found(f"Previous response with id '{rid}' not found.",
                        "previous_response_id") from None
    if req.input is None:
        raise bad_request("input is required", "input")
    return msgspec.structs.replace(req, input=[*prior, *input_items(req.input)],
                                   previous_response_id=None)


def _base(req: ResponsesRequest, model: str, store: bool) -> dict[str, Any]:
    """The response object's fields that echo the request."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": _id("resp"), "object": "response", "created_at": int(time.time()),
        "model": model, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "store": store, "temperature": req.temperature, "top_p": req.top_p,
        "top_logprobs": req.top_logprobs, "text": {**(req.text or {}), "format": fmt},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "truncation": req.truncation or "disabled",
        "user": req.user,
    }


@dataclass
class _Item:
    """One output item as it grows."""

    kind: str
    """``reasoning``, ``message`` or ``function_call``."""
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"
    logprobs: list[dict] = field(default_factory=list)
    """A message's: its tokens' logprobs (chat's ``logprobs.content`` items)."""

    def body(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": self.text}]}
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": [] if status == "in_progress" else [self.part()]}
        return {"id": self.id, "type": "function_call", "status": status,
                "call_id": self.call_id, "name": self.name, "arguments": self.text}

    def part(self, text: str | None = None) -> dict[str, Any]:
        """The item's content part: as it is now, or (``text``) as it began."""
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text if text is None else text}
        if text is not None:
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": self.logprobs}


@dataclass
class _Output:
    """The response's items, built from the generation's text; with :meth:`run`, the
    stream events of each step."""

    base: dict[str, Any]
    input_tokens: int
    parser: ChoiceParser
    items: list[_Item] = field(default_factory=list)
    calls: dict[int, _Item] = field(default_factory=dict)
    """Tool call index -> its item."""
    open: _Item | None = None
    tally: ChoiceTally = field(default_factory=ChoiceTally)
    finish: str | None = None
    seq: int = 0
    streaming: bool = True
    """Events are encoded (a whole response needs only its items)."""
    on_done: Callable[[dict[str, Any]], None] | None = None
    """Called with the finished response before its last event (stored responses)."""
    pieces: TokenPieces | None = None
    """Set when the message carries logprobs (the tokens' pieces for them)."""
    special: frozenset[int] = frozenset()
    """Token ids never in the message's logprobs (end of turn, tool-call tags)."""
    held: list[tuple[dict, int]] = field(default_factory=list)
    """Logprobs (and text widths) of tokens whose text the parsers hold back."""

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        if not self.streaming:
            return b""
        obj = {"type": kind, "sequence_number": self.seq - 1, **fields}
        return b"event: " + kind.encode() + b"\ndata: " + _encode(obj) + b"\n\n"

    @property
    def status(self) -> str:
        """The end status (of the response and of the item open at the end):
        ``incomplete`` when the token limit cut it."""
        return "incomplete" if self.finish == "length" else "completed"

    def response(self, status: str | None = None) -> dict[str, Any]:
        status = status or self.status
        done = status != "in_progress"
        t = self.tally
        return {**self.base, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "output": [it.body(it.status) for it in self.items] if done else [],
                "usage": None if not done else {
                    "input_tokens": self.input_tokens,
                    "input_tokens_details": {"cached_tokens": t.cached_tokens},
                    "output_tokens": t.completion_tokens,
                    "output_tokens_details": {
                        "reasoning_tokens": self.parser.reasoning_tokens},
                    "total_tokens": self.input_tokens + t.completion_tokens}}

    def failed(self, err: APIError) -> bytes:
        """The ``response.failed`` event of an error after the 200."""
        failed = {**self.response("failed"),
                  "error": {"code": "server_error", "message": str(err)}}
        return self.event("response.failed", response=failed)

    async def run(self, gen: Generation):
        """Feed the generation through the parsers; yields each step's events."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        async for updates in choice_updates(gen, 1, self.tally):
            for _, c in updates:
                yield b"".join(self._feed(c.text, len(c.token_ids), c.finish_reason,
                                          c.logprobs or []))  # fmt: skip
        if not self.items:  # nothing at all was generated: one empty message
            yield self._add(_Item("message", _id("msg")))
        yield self._close()
        response = self.response()
        if self.on_done is not None:  # before the last event: a client may continue it
            self.on_done(response)
        yield self.event(f"response.{self.status}", response=response)

    def _message_logprobs(self, entries: list, reasoning: bool, content: str,
                          other: bool) -> list[dict]:
        """The logprobs of the tokens whose text is ``content``: those of this step and
        held ones, the last of them whose widths cover it. A step inside the reasoning
        (as ``reasoning_tokens`` counts it) and one whose text went to reasoning or calls
        only contribute none."""
        new = [(lp, self.pieces(e.token_id).width) for lp, e in zip(
            chat_logprobs(entries, self.pieces), entries, strict=True)
            if e.token_id not in self.special]  # fmt: skip
        if reasoning or (other and not content):
            self.held = []
            return []
        self.held += new
        if not content:
            return []
        take, need = [], len(content)
        for lp, width in reversed(self.held):
            if need <= 0:
                break
            take.append(lp)
            need -= width
        self.held = []
        return take[::-1]

    def _feed(self, text: str, num_tokens: int, finish: str | None, entries=()) -> list[bytes]:
        rp = self.parser.reasoning
        reasoning = rp is not None and rp.in_reasoning
        thought, content, calls = self.parser.feed(text, finish is not None, num_tokens)
        reasoning = reasoning or (rp is not None and rp.in_reasoning)
        lps = [] if self.pieces is None else \
            self._message_logprobs(entries, reasoning, content, bool(thought or calls))
        if finish is not None:
            self.finish = finish
        # The rest of a call already open comes before any text or call after it.
        out = [self._arguments(c) for c in calls if c["index"] in self.calls]
        if thought:
            out += self._grow("reasoning", thought, "response.reasoning_text.delta")
        if content:
            out += self._grow("message", content, "response.output_text.delta", logprobs=lps)
            self.open.logprobs += lps
        for call in calls:
            if call["index"] not in self.calls:
                out.append(self._close())
                self.calls[call["index"]] = _Item("function_call", _id("fc"),
                                                  call_id=call["id"],
                                                  name=call["function"]["name"])
                out += [self._add(self.calls[call["index"]]), self._arguments(call)]
        return out

    def _arguments(self, call: dict[str, Any]) -> bytes:
        item, args = self.calls[call["index"]], call["function"].get("arguments", "")
        if not args:
            return b""
        item.text += args
        return self.event("response.function_call_arguments.delta", item_id=item.id,
                          output_index=self._index(item), delta=args)

    def _index(self, item: _Item) -> int:
        return self.items.index(item)

    def _add(self, item: _Item) -> bytes:
        self.items.append(item)
        self.open = item
        added = self.event("response.output_item.added", output_index=self._index(item),
                           item=item.body("in_progress"))
        if item.kind == "function_call":
            return added
        return added + self.event("response.content_part.added", item_id=item.id,
                                  output_index=self._index(item), content_index=0,
                                  part=item.part(""))

    def _grow(self, kind: str, piece: str, delta_event: str, **extra: Any) -> list[bytes]:
        out = []
        if self.open is None or self.open.kind != kind:
            out += [self._close(), self._add(_Item(kind, _id("rs" if kind == "reasoning"
                                                           else "msg")))]
        item = self.open
        item.text += piece
        out.append(self.event(delta_event, item_id=item.id, output_index=self._index(item),
                              content_index=0, delta=piece, **extra))
        return out

    def _close(self) -> bytes:
        """Events that close the open item (none if no item is open)."""
        item, self.open = self.open, None
        if item is None:
            return b""
        i = self._index(item)
        status = item.status = self.status
        if item.kind == "function_call":
            out = self.event("response.function_call_arguments.done", item_id=item.id,
                             output_index=i, name=item.name, arguments=item.text)
        else:
            done = ("response.reasoning_text.done" if item.kind == "reasoning"
                    else "response.output_text.done")
            extra = {} if item.kind == "reasoning" else {"logprobs": item.logprobs}
            out = self.event(done, item_id=item.id, output_index=i, content_index=0,
                             text=item.text, **extra)
            out += self.event("response.content_part.done", item_id=item.id,
                              output_index=i, content_index=0, part=item.part())
        return out + self.event("response.output_item.done", output_index=i,
                                item=item.body(status))


async def _stream(request: web.Request, gen: Generation, out: _Output) -> web.StreamResponse:
    resp = await open_stream(request)
    request[STREAM_ERROR_KEY] = out.failed  # also for a deadline the middleware enforces
    try:
        async for frames in out.run(gen):
            if frames:
                await resp.write(frames)
    except APIError as err:
        await send_error_and_done(resp, err)
    except ConnectionResetError:
        pass  # the client went away; leaving the Generation aborts the request
    return resp
