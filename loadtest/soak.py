"""Soak: mixed traffic at a server for a long run, then what leaked.

Workers send streaming and whole chat and completion requests, Responses API turns
(half of them continuing a stored response), embeddings, drop streams half-way (client
disconnects), send bad requests, and every ``--burst-every`` seconds a burst
past the waiting limit (429s expected). Meanwhile ``/health`` is probed every 100 ms and
the server's RSS and open file descriptors are sampled every 10 s. The report: requests
by outcome, RSS at the start, after 2 minutes and at the end, descriptors, KV cache use,
running and waiting requests at the end (all must be 0), and ``/health`` latency.

By default the server is started here (``--server-args``, the embedded default model);
``--base-url`` with ``--server-pid`` soaks one already running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pagedserve.loadtest.server_metrics import metric_total

READY = re.compile(r"pagedserve ready on (http://\S+)")
DEFAULT_SERVER_ARGS = ("--max-model-len 2048 --kv-cache-memory-gb 0.5 --max-num-seqs 16 "
                       "--max-waiting-requests 32 --log-level warning")
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``pagedserve bench soak``."""
    p.add_argument("--duration", type=_duration, default=600.0,
                   help="how long to run: seconds, or with a unit (90s, 10m, 1h) "
                        "(default: 10m)")
    p.add_argument("--base-url", default=None, help="soak a running server at this URL")
    p.add_argument("--server-pid", type=int, default=None,
                   help="its process id, for RSS and descriptors (with --base-url)")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help="flags of the server started here (default: %(default)r)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--concurrency", type=int, default=6, help="workers (default: 6)")
    p.add_argument("--max-tokens", type=int, default=48,
                   help="most tokens per generated reply (default: %(default)s)")
    p.add_argument("--burst-every", type=float, default=30.0,
                   help="seconds between bursts past the waiting limit (default: 30)")
    p.add_argument("--burst-size", type=int, default=64,
                   help="requests per burst (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, metavar="FILE.json")


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Soak:
    def __init__(self, args: argparse.Namespace, base_url: str, pid: int | None) -> None:
        self.args = args
        self.url = base_url
        self.pid = pid
        self.rng = random.Random(args.seed)
        self.outcomes: Counter[str] = Counter()
        self.health: list[tuple[float, float]] = []
        self.samples: list[dict[str, float]] = []
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.t0 = 0.0
        self.deadline = 0.0
        self.last_response: str | None = None
        """A stored response that no turn has continued yet."""

    # -- traffic ------------------------------------------------------------------------
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

    async def _bad(self, session: Any) -> str:
        route, body = self.rng.choice(BAD_BODIES)
        async with session.post(self.url + route, data=body, headers={
                **self.headers, "Content-Type": "application/json"}) as r:
            await r.read()
            return "bad_request_refused" if 400 <= r.status < 500 else f"http_{r.status}"

    async def _one(self, session: Any) -> str:
        x = self.rng.random()
        try:
            if x < 0.08:
                outcome = await self._bad(session)
            elif x < 0.14:
                outcome = await self._embed(session)
            elif x < 0.22:
                outcome = await self._respond(session)
            elif x < 0.3:
                outcome = await self._generate(session, self.rng.random() < 0.5, True, True)
            else:
                outcome = await self._generate(session, x < 0.6, self.rng.random() < 0.6)
        except asyncio.TimeoutError:
            outcome = "lost_timeout"
        except Exception as e:  # noqa: BLE001 - every failure is an outcome to count
            outcome = f"lost_{type(e).__name__}"
        self.outcomes[outcome] += 1
        return outcome

    async def _worker(self, session: Any) -> None:
        while time.monotonic() < self.deadline:
            if await self._one(session) == "rate_limited":
                await asyncio.sleep(1.0)  # as Retry-After says

    async def _bursts(self, session: Any) -> None:
        while True:
            next_burst = time.monotonic() + self.args.burst_every
            if next_burst >= self.deadline:
                return
            await asyncio.sleep(self.args.burst_every)
            await asyncio.gather(*(self._one(session) for _ in range(self.args.burst_size)))

    # -- probes ---------------------------------------------------------------------------
    async def _health(self, session: Any) -> None:
        while time.monotonic() < self.deadline:
            t = time.monotonic()
            try:
                async with session.get(self.url + "/health") as r:
                    await r.read()
                    ok = r.status == 200
            except Exception:  # noqa: BLE001
                ok = False
            self.health.append((t - self.t0, (time.monotonic() - t) if ok else float("inf")))
            await asyncio.sleep(0.1)

    async def _sampler(self) -> None:
        while True:
            self._sample()
            if time.monotonic() >= self.deadline:
                return
            await asyncio.sleep(min(10.0, max(0.0, self.deadline - time.monotonic())))

    def _sample(self) -> None:
        if self.pid is not None:
            self.samples.append({"t": time.monotonic() - self.t0, "rss_mb": _rss_mb(self.pid),
                                 "fds": _num_fds(self.pid)})

    async def run(self) -> dict[str, Any]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=120)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
            self.t0 = time.monotonic()
            self.deadline = self.t0 + self.args.duration
            tasks = [asyncio.create_task(self._worker(session))
                     for _ in range(self.args.concurrency)]
            tasks += [asyncio.create_task(c) for c in (
                self._bursts(session), self._health(session), self._sampler())]
            await asyncio.gather(*tasks)
        # The client's pooled connections are closed first, so that the descriptors
        # counted at the end are what the server kept, not what the client holds open.
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.sleep(1.0)
            return await self._report(session)

    async def _report(self, session: Any) -> dict[str, Any]:
        idle = None
        for _ in range(100):  # the last aborts settle within a step or two
            async with session.get(self.url + "/metrics", headers=self.headers) as r:
                text = await r.text()
            idle = {k: metric_total(text, f"pagedserve:{k}") for k in (
                "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")}
            if not any(idle.values()):
                break
            await asyncio.sleep(0.1)
        self._sample()
        lat = [v for _, v in self.health]
        after2 = [s for s in self.samples if s["t"] >= 120] or self.samples
        rss = {"start_mb": self.samples[0]["rss_mb"], "minute2_mb": after2[0]["rss_mb"],
               "end_mb": self.samples[-1]["rss_mb"]} if self.samples else {}
        if rss:
            rss["growth_after_minute2_pct"] = 100 * (rss["end_mb"] / rss["minute2_mb"] - 1)
        return {
            "duration_s": self.args.duration,
            "requests": sum(self.outcomes.values()),
            "outcomes": dict(sorted(self.outcomes.items())),
            "server_errors": sum(v for k, v in self.outcomes.items()
                                 if k.startswith(("http_5", "stream_error_5"))),
            "lost": sum(v for k, v in self.outcomes.items()
                        if k.startswith("lost_") or k == "stream_cut"),
            "rss": rss,
            "fds": {"start": self.samples[0]["fds"], "end": self.samples[-1]["fds"]}
            if self.samples else {},
            "rss_samples": [[round(s["t"]), round(s["rss_mb"], 1)] for s in self.samples],
            "end_state": idle,
            "health": {"probes": len(lat), "failed": sum(v == float("inf") for v in lat),
                       "p50_ms": 1000 * _percentile(lat, 0.5),
                       "p99_ms": 1000 * _percentile(lat, 0.99),
                       "p99_ms_by_minute": [
                           round(1000 * _percentile([v for t, v in self.health
                                                     if m * 60 <= t < (m + 1) * 60], 0.99), 1)
                           for m in range(max(1, int(self.args.duration // 60)))],
                       "max_ms": 1000 * max(lat, default=float("nan"))},
        }


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pagedserve.server.cli", "serve", "--port", "0",
           *shlex.split(args.server_args)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        m = READY.search(line)
        if m:
            import threading

            threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stdout],
                             daemon=True).start()
            return proc, m.group(1)
    raise SystemExit(f"error: the server exited ({proc.wait()}) before it was ready")


def format_report(r: dict[str, Any]) -> str:
    lines = [f"soak: {r['duration_s']:.0f}s, {r['requests']} requests"]
    lines += [f"  {k:<24} {v}" for k, v in r["outcomes"].items()]
    lines.append(f"server errors (5xx): {r['server_errors']}   lost: {r['lost']}")
    if r["rss"]:
        x = r["rss"]
        lines.append(f"RSS MiB: start {x['start_mb']:.1f}, minute 2 {x['minute2_mb']:.1f}, "
                     f"end {x['end_mb']:.1f} ({x['growth_after_minute2_pct']:+.2f}% after "
                     "minute 2)")
        lines.append(f"open fds: start {r['fds']['start']}, end {r['fds']['end']}")
    lines.append(f"at the end: {r['end_state']}")
    h = r["health"]
    lines.append(f"/health: {h['probes']} probes, {h['failed']} failed, p50 {h['p50_ms']:.1f} "
                 f"ms, p99 {h['p99_ms']:.1f} ms, max {h['max_ms']:.1f} ms")
    lines.append(f"/health p99 by minute (ms): {h['p99_ms_by_minute']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``pagedserve bench soak``; the report."""
    proc = None
    if args.base_url:
        url, pid = args.base_url.rstrip("/"), args.server_pid
    else:
        proc, url = _start_server(args)
        pid = proc.pid
    try:
        report = asyncio.run(Soak(args, url, pid).run())
    finally:
        if proc is not None:
            proc.terminate()
            report_exit = proc.wait(60)
    if proc is not None:
        report["server_exit_status"] = report_exit
    print(format_report(report), flush=True)
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"saved: {path}")
    return report
