"""Locust users for a running pagedserve (or any OpenAI-compatible) server.

Each user sends chat completions to ``/v1/chat/completions``, streamed or not, and
waits a think time between requests. A streamed request is validated with the
benchmark's stream checker (:class:`pagedserve.loadtest.sse_check.StreamChecker`): a stream
without ``data: [DONE]`` last, without exactly one finish chunk per choice, with an
in-stream error or no content is a failure. Besides the request entries
(``POST chat stream`` / ``POST chat``, timed to the end of the body), every stream
reports two entries of its own:

- ``TTFT``  (request type ``TTFT``): time to the first chunk with content;
- ``ITL``   (request type ``ITL``): one sample per gap between content chunks.

Run it with ``make loadtest`` (starts a server) or against a server of your own::

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 2 -t 60s

Settings: the ``PAGEDSERVE_LOCUST_*`` variables and ``PAGEDSERVE_API_KEY`` (sent as
``Authorization: Bearer KEY`` when set), all optional, each documented once in
:mod:`pagedserve.engine.envs` (docs/environment.md's table of environment variables).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from locust import FastHttpUser, between, task

from pagedserve.engine import envs  # the standard library only: no torch here
from pagedserve.loadtest.datasets import CONVERSATIONS_FILE, load_conversations
from pagedserve.loadtest.sse_check import StreamChecker

MAX_TOKENS = envs.locust_max_tokens()
IGNORE_EOS = envs.locust_ignore_eos()
STREAM_RATIO = envs.locust_stream_ratio()
WAIT_MIN = envs.locust_wait_min()
WAIT_MAX = envs.locust_wait_max()
TEMPERATURE = envs.locust_temperature()
MODEL = envs.locust_model()
API_KEY = envs.api_key()


def load_prompts(spec: str) -> list[list[dict[str, str]]]:
    """The message lists of a prompt set (see ``PAGEDSERVE_LOCUST_PROMPTS``).

    A conversation contributes one prompt per assistant turn: the messages before it.
    """
    if spec in ("", "conversation"):
        path = CONVERSATIONS_FILE
    else:
        path = Path(spec)
    if path.suffix == ".jsonl":
        prompts = []
        for msgs in load_conversations(path):
            prompts.extend(msgs[:i] for i, m in enumerate(msgs)
                           if m["role"] == "assistant" and i > 0)
            if msgs[-1]["role"] == "user":
                prompts.append(msgs)
    else:
        lines = path.read_text(encoding="utf-8").splitlines()
        prompts = [[{"role": "user", "content": ln}] for ln in lines if ln.strip()]
    if not prompts:
        raise ValueError(f"no prompt in {path}")
    return prompts


PROMPTS = load_prompts(envs.locust_prompts())


def read_events(response: Any) -> Any:
    """Yield the SSE body of a ``stream=True`` FastHttp response one event at a time.

    geventhttpclient's ``readline`` returns as soon as a whole event has arrived, so the
    arrival times are those of the events; ``iter_content`` is the fallback.
    """
    raw = getattr(response, "_response", None)
    if raw is not None and hasattr(raw, "readline"):
        while True:
            event = raw.readline(b"\n\n")
            if not event:
                return
            yield event
    else:  # pragma: no cover - other locust versions
        yield from response.iter_content(chunk_size=1, decode_content=False)


class ChatUser(FastHttpUser):
    """A chat client: one chat completion (streamed with ``STREAM_RATIO``), then think time."""

    wait_time = between(WAIT_MIN, WAIT_MAX)
    model: str | None = MODEL

    def on_start(self) -> None:
        if self.model is None:
            with self.client.get("/v1/models", name="GET /v1/models",
                                 headers=self._headers(), catch_response=True) as resp:
                try:
                    ChatUser.model = resp.json()["data"][0]["id"]
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    resp.failure(f"cannot read the model id: {e}")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}

    def _body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": random.choice(PROMPTS),
                                "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
                                "stream": stream}
        if IGNORE_EOS:
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _report(self, request_type: str, name: str, ms: float) -> None:
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=ms, response_length=0,
            exception=None, context={})

    @task
    def chat(self) -> None:
        if random.random() < STREAM_RATIO:
            self.chat_stream()
        else:
            self.chat_once()

    def chat_once(self) -> None:
        """A non-streamed chat completion: one choice with a finish reason."""
        with self.client.post("/v1/chat/completions", json=self._body(False),
                              headers=self._headers(), name="POST chat",
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                return
            try:
                data = resp.json()
                choice = data["choices"][0]
                if choice.get("finish_reason") is None:
                    resp.failure("no finish_reason")
                elif data.get("usage") is None:
                    resp.failure("no usage")
                else:
                    resp.success()
            except (ValueError, KeyError, IndexError, TypeError) as e:
                resp.failure(f"malformed response: {e}")

    def chat_stream(self) -> None:
        """A streamed chat completion, validated chunk by chunk; reports TTFT and ITL."""
        start = time.perf_counter()
        checker = StreamChecker(expected_choices=1, expect_usage=True)
        with self.client.post("/v1/chat/completions", json=self._body(True),
                              headers=self._headers(), name="POST chat stream",
                              stream=True, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            size = 0
            try:
                for event in read_events(resp):
                    size += len(event)
                    checker.feed(event, time.perf_counter())
            except Exception as e:  # noqa: BLE001 - any transport error fails the request
                resp.failure(f"stream broken: {type(e).__name__}: {e}")
                return
            total_ms = (time.perf_counter() - start) * 1000.0
            resp.request_meta["response_time"] = total_ms
            resp.request_meta["response_length"] = size
            violations = checker.close()
            times = checker.content_times
            if checker.error is not None:
                resp.failure(f"error event: {checker.error}")
            elif not times:
                resp.failure("no chunk carried content")
            elif violations:
                resp.failure("stream violation: " + "; ".join(violations))
            else:
                resp.success()
        if times:
            self._report("TTFT", "chat stream", (times[0] - start) * 1000.0)
            for a, b in zip(times, times[1:], strict=False):
                self._report("ITL", "chat stream", (b - a) * 1000.0)

