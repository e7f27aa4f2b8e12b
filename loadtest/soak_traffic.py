"""The soak's traffic: every kind of request ``pagedserve bench soak`` sends, each ending in
a counted outcome (``ok``, an expected refusal, or what went wrong)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

KINDS = ("bad", "embed", "responses", "structured", "tools", "lora", "disconnect", "generate")
WEIGHTS = (0.06, 0.05, 0.07, 0.07, 0.07, 0.08, 0.08, 0.52)
SCHEMA = {"type": "object", "properties": {
    "word": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["word", "count"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
BAD_BODIES: list[tuple[str, bytes]] = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                             b'"model": "nope"}'),
    ("/v1/completions", b'{"prompt": [1, 2, 99999999]}'),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"\xc2\xb2": 1}}'),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/detokenize", b'{"tokens": [-1]}'),
]
WORDS = ("alpha", "river", "stone", "cloud", "paper", "green", "quiet", "north", "light")


class Traffic:
    """Requests of every kind against ``url``; ``outcomes`` counts how each ended."""

    def __init__(self, url: str, args: Any, rng: random.Random, headers: dict[str, str]) -> None:
        self.url = url
        self.args = args
        self.rng = rng
        self.headers = headers
        self.outcomes: Counter[str] = Counter()
        self.last_response: str | None = None
        """A stored response that no turn has continued yet."""
        self.lora_path: str | None = getattr(args, "lora_path", None)
        self.loras: list[str] = []
        """The adapters loaded now, oldest first."""
        self.lora_names_seen: set[str] = set()
        self.lora_ops: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        """Requests sent, by kind."""
        self.deadline = 0.0

    def _prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 40)))

    def _body(self, chat: bool, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.rng.randint(1, self.args.max_tokens),
                                "temperature": self.rng.choice([0.0, 0.7]), "stream": stream}
        if self.rng.random() < 0.2:
            body["n"] = self.rng.randint(2, 3)
        if chat:
            body["messages"] = [{"role": "user", "content": self._prompt()}]
        else:
            body["prompt"] = self._prompt()
        return body

    async def _generate(self, session: Any, chat: bool, stream: bool,
                        disconnect: bool = False) -> str:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        async with session.post(self.url + route, json=self._body(chat, stream or disconnect),
                                headers=self.headers) as r:
            if (bad := await self._status(r)) is not None:
                return bad
            if not (stream or disconnect):
                data = await r.json()
                ok = all(c.get("finish_reason") in ("stop", "length") for c in data["choices"])
                return "ok" if ok else "bad_finish"
            events = 0
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                events += 1
                if disconnect and events >= 2:
                    return "client_disconnect"  # leaving the block closes the connection
                if line.startswith(b"data: [DONE]"):
                    return "ok"
                if line.startswith(b'data: {"error"'):
                    code = json.loads(line[6:])["error"]["code"]
                    return "rate_limited" if code == 429 else f"stream_error_{code}"
            return "ok" if disconnect else "stream_cut"

    async def _status(self, r: Any) -> str | None:
        """The outcome of a response that is not a 200 (None for a 200)."""
        if r.status == 200:
            return None
        await r.read()
        return "rate_limited" if r.status == 429 else f"http_{r.status}"

    async def _embed(self, session: Any) -> str:
        inputs = [self._prompt() for _ in range(self.rng.randint(1, 3))]
        async with session.post(self.url + "/v1/embeddings", headers=self.headers, json={
                "input": inputs, "encoding_format": self.rng.choice(["float", "base64"])}) as r:
            if (bad := await self._status(r)) is not None:
                return bad
            data = await r.json()
            return "ok" if [d["index"] for d in data["data"]] == list(range(len(inputs))) \
                else "bad_embedding"  # fmt: skip

    async def _respond(self, session: Any) -> str:
        """A Responses API turn: whole or streamed, and half the time the continuation of
        the last stored one (a conversation of two turns at most)."""
        body: dict[str, Any] = {"input": " ".join(self.rng.choice(WORDS) for _ in range(
            self.rng.randint(2, 10))), "max_output_tokens": self.rng.randint(1, self.args.max_tokens),
            "stream": self.rng.random() < 0.4}  # fmt: skip
        if self.last_response is not None and self.rng.random() < 0.5:
            body["previous_response_id"], self.last_response = self.last_response, None
        async with session.post(self.url + "/v1/responses", json=body,
                                headers=self.headers) as r:  # fmt: skip
            if (bad := await self._status(r)) is not None:
                return bad
            if not body["stream"]:
                data = await r.json()
                ended = data["status"]
            else:
                ended = None
                async for line in r.content:
                    if line.startswith(b"data: "):
                        data = json.loads(line[6:])
                        ended = data["type"].removeprefix("response.")
                data = data.get("response", {})
            if ended not in ("completed", "incomplete"):
                return f"response_{ended}"
            if "previous_response_id" not in body:
                self.last_response = data["id"]
            return "ok"

    async def _chat(self, session: Any, body: dict[str, Any]) -> tuple[str | None, Any]:
        """A whole chat completion: (the outcome if it is not a 200, the body)."""
        async with session.post(self.url + "/v1/chat/completions", json=body,
                                headers=self.headers) as r:  # fmt: skip
            if r.status == 404 and body.get("model") in self.lora_names_seen:
                await r.read()
                return "lora_unloaded", None
            if (bad := await self._status(r)) is not None:
                return bad, None
            return None, await r.json()

    async def _structured(self, session: Any) -> str:
        """A reply held to a JSON schema: when it ends by itself it must satisfy it."""
        bad, data = await self._chat(session, {
            "messages": [{"role": "user", "content": "A word and a number: " + self._prompt()}],
            "max_tokens": self.rng.randint(8, max(8, self.args.max_tokens)),
            "temperature": self.rng.choice([0.0, 0.7]),
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "pair", "schema": SCHEMA}}})
        if bad is not None:
            return bad
        choice = data["choices"][0]
        if choice["finish_reason"] == "length":
            return "ok"
        try:
            reply = json.loads(choice["message"]["content"])
        except (TypeError, ValueError):
            return "bad_structured"
        return "ok" if set(reply) == {"word", "count"} and isinstance(reply["count"], int) \
            and isinstance(reply["word"], str) else "bad_structured"  # fmt: skip

    async def _tools(self, session: Any) -> str:
        """A turn with a tool: ``required`` or a named tool must end in a call whose
        arguments are a JSON object."""
        choice = self.rng.choice(["auto", "required", "named"])
        bad, data = await self._chat(session, {
            "messages": [{"role": "user", "content": "Weather? " + self._prompt()}],
            "max_tokens": self.rng.randint(16, max(16, self.args.max_tokens)),
            "tools": [TOOL], "tool_choice": {"type": "function", "function": {
                "name": "get_weather"}} if choice == "named" else choice})  # fmt: skip
        if bad is not None:
            return bad
        c = data["choices"][0]
        if c["finish_reason"] not in ("tool_calls", "stop", "length"):
            return "bad_finish"
        if choice != "auto" and c["finish_reason"] != "length":
            calls = c["message"].get("tool_calls") or []
            try:
                ok = bool(calls) and all(isinstance(json.loads(
                    t["function"]["arguments"]), dict) for t in calls)  # fmt: skip
            except (TypeError, ValueError):
                ok = False
            return "ok" if ok else "bad_tool_call"
        return "ok"

    async def _lora(self, session: Any) -> str:
        """A request through one of the adapters loaded now."""
        if not self.loras:
            return await self._generate(session, True, False)
        body = self._body(True, False)
        body["model"] = self.rng.choice(self.loras)
        bad, data = await self._chat(session, body)
        if bad is not None:
            return bad
        ok = all(c.get("finish_reason") in ("stop", "length") for c in data["choices"])
        return "ok" if ok else "bad_finish"

    async def _lora_admin(self, session: Any) -> None:
        """Load an adapter under a new name every ``--lora-every`` seconds and unload the
        oldest once two are loaded: adapters come and go under the traffic."""
        k = 0
        while time.monotonic() + self.args.lora_every < self.deadline:
            await asyncio.sleep(self.args.lora_every)
            name = f"soak-lora-{k}"
            k += 1
            self.lora_names_seen.add(name)
            ok = await self._admin(session, "load", {"lora_name": name,
                                                     "lora_path": self.lora_path})
            if ok:
                self.loras.append(name)
            if len(self.loras) > 2:
                old = self.loras.pop(0)
                await self._admin(session, "unload", {"lora_name": old})

    async def _admin(self, session: Any, op: str, body: dict[str, str]) -> bool:
        try:
            async with session.post(f"{self.url}/v1/{op}_lora_adapter", json=body,
                                    headers=self.headers) as r:  # fmt: skip
                await r.read()
                outcome = f"{op}_ok" if r.status == 200 else f"{op}_http_{r.status}"
        except Exception as e:  # noqa: BLE001 - every failure is an outcome to count
            outcome = f"{op}_lost_{type(e).__name__}"
        self.lora_ops[outcome] += 1
        return outcome == f"{op}_ok"

    async def _bad(self, session: Any) -> str:
        route, body = self.rng.choice(BAD_BODIES)
        async with session.post(self.url + route, data=body, headers={
                **self.headers, "Content-Type": "application/json"}) as r:
            await r.read()
            return "bad_request_refused" if 400 <= r.status < 500 else f"http_{r.status}"

    async def _one(self, session: Any) -> str:
        kind = self.rng.choices(KINDS, WEIGHTS)[0]
        self.kinds[kind] += 1
        handlers = {"bad": self._bad, "embed": self._embed, "responses": self._respond,
                    "structured": self._structured, "tools": self._tools, "lora": self._lora}
        try:
            if kind in handlers:
                outcome = await handlers[kind](session)
            elif kind == "disconnect":
                outcome = await self._generate(session, self.rng.random() < 0.5, True, True)
            else:
                outcome = await self._generate(session, self.rng.random() < 0.5,
                                               self.rng.random() < 0.6)
        except asyncio.TimeoutError:
            outcome = "lost_timeout"
        except Exception as e:  # noqa: BLE001 - every failure is an outcome to count
            outcome = f"lost_{type(e).__name__}"
        self.outcomes[outcome] += 1
        return outcome
