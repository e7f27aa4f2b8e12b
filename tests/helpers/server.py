"""Start a real ``pagedserve serve`` in a subprocess and wait for its ready line.

Used by the server tests and handy for benchmarks::

    with ServerProcess(["--max-num-batched-tokens", "256"]) as srv:
        print(srv.url)
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("tests.helpers.server")

REPO_ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"pagedserve ready on (http://\S+)")


class ServerProcess:
    """A server subprocess on a free port (``--port 0``); output is collected in :attr:`lines`."""

    def __init__(self, args: Sequence[str] = (), env: dict[str, str] | None = None,
                 ready_timeout: float = 300.0, python: str | Path | None = None,
                 cwd: str | Path | None = None) -> None:
        """``python`` and ``cwd``: the interpreter that runs the server and its working
        folder (default: this one, in the repository root)."""
        self.args = list(args)
        self.python = str(python or sys.executable)
        self.cwd = cwd or REPO_ROOT
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.lines: list[str] = []
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def start(self) -> ServerProcess:
        cmd = [self.python, "-m", "pagedserve.server.cli", "serve", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=self.env, cwd=self.cwd)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("the server did not become ready:\n" + self.output)
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = READY.search(line)
            if m and not self._ready.is_set():
                self.url = m.group(1)
                self._ready.set()

    def openai_client(self, api_key: str = "unused", asynchronous: bool = False):
        """The official ``openai`` client (``AsyncOpenAI`` with ``asynchronous``) on this
        server, without retries: a test sees every error as the server sent it."""
        import openai

        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL if needed; the exit status."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait(5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body into event payloads, checking the exact ``data: ...\\n\\n`` framing."""
    if not raw.endswith(b"\n\n"):
        raise AssertionError(f"the stream does not end with a blank line: {raw[-40:]!r}")
    events = raw[:-2].split(b"\n\n")
    for ev in events:
        if not ev.startswith(b"data: ") or b"\n" in ev:
            raise AssertionError(f"malformed SSE event: {ev[:80]!r}")
    return [ev[len(b"data: "):] for ev in events]


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus text exposition (None if absent)."""
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def run_in_process(engine, options, script):
    """``await script(client)`` against the app of ``engine`` (an ``LLMEngine``) served
    in this process with ``options`` (a ``ServeOptions``); its result. The engine thread
    stops afterwards."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from pagedserve.engine.loop.async_engine import AsyncEngine
    from pagedserve.server.app import build_app
    from pagedserve.server.state import ServerState

    async def main():
        ae = AsyncEngine(engine)
        ae.start(asyncio.get_running_loop())
        state = ServerState(ae, options)
        try:
            async with TestClient(TestServer(build_app(state))) as client:
                return await script(client)
        finally:
            ae.shutdown()
            state.close()

    return asyncio.run(main())


def post_to_handler(state, handler) -> bytes:
    """The body of a POST to an app whose one route is ``handler``, with ``state`` (a
    real or fake ``ServerState``) as its server state: a route's response code on a
    fake engine."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from pagedserve.server.state import STATE_KEY

    async def main():
        app = web.Application()
        app[STATE_KEY] = state
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as client:
            return await (await client.post("/")).read()

    return asyncio.run(main())
