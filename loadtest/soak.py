"""Soak: mixed traffic at a server for a long run, then what leaked.

Workers send streaming and whole chat and completion requests, Responses API turns
(half of them continuing a stored response), embeddings, structured outputs (a JSON
schema the reply must satisfy), tool calls (``auto``, ``required`` and a named tool),
requests through a LoRA adapter, drop streams half-way (client disconnects), send bad
requests, and every ``--burst-every`` seconds a burst past the waiting limit (429s
expected). Meanwhile adapters are loaded and unloaded under the traffic every
``--lora-every`` seconds (``/v1/load_lora_adapter``; a request naming an adapter unloaded
an instant before is a 404, counted as ``lora_unloaded``). Meanwhile ``/health`` is probed every 100 ms and
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
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedserve.loadtest.server_metrics import metric_total
from pagedserve.loadtest.soak_traffic import Traffic

READY = re.compile(r"pagedserve ready on (http://\S+)")
DEFAULT_SERVER_ARGS = ("--max-model-len 2048 --kv-cache-memory-gb 0.5 --max-num-seqs 16 "
                       "--max-waiting-requests 32 --log-level warning")
FEATURE_ARGS = ("--enable-auto-tool-choice --tool-call-parser hermes --enable-lora "
                "--allow-runtime-lora-updating --max-lora-rank 8 --max-loras 2")
"""Added to the server's flags: the features the soak's traffic uses."""


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
    p.add_argument("--lora-path", default=None,
                   help="a PEFT LoRA adapter of the served model, loaded and unloaded under "
                        "the traffic (default: a random one is written for the server "
                        "started here; none against --base-url)")
    p.add_argument("--lora-every", type=float, default=5.0,
                   help="seconds between adapter loads and unloads (default: 5)")
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


class Soak(Traffic):
    """The traffic from ``--concurrency`` workers and the bursts, with the probes."""

    def __init__(self, args: argparse.Namespace, base_url: str, pid: int | None) -> None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        super().__init__(base_url, args, random.Random(args.seed), headers)
        self.pid = pid
        self.health: list[tuple[float, float]] = []
        self.samples: list[dict[str, float]] = []
        self.t0 = 0.0

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
            if self.lora_path:
                tasks.append(asyncio.create_task(self._lora_admin(session)))
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
            "kinds": dict(sorted(self.kinds.items())),
            "lora_ops": dict(sorted(self.lora_ops.items())),
            "server_errors": sum(v for k, v in self.outcomes.items()
                                 if k.startswith(("http_5", "stream_error_5")))
            + sum(v for k, v in self.lora_ops.items() if "_http_5" in k),
            "lost": sum(v for k, v in self.outcomes.items()
                        if k.startswith("lost_") or k == "stream_cut")
            + sum(v for k, v in self.lora_ops.items() if "_lost_" in k),
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
           *shlex.split(args.server_args), *shlex.split(FEATURE_ARGS)]
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


def write_adapter(server_args: str, out: Path) -> str:
    """A random rank-8 LoRA adapter of the model ``server_args`` serve (``--model``, else
    the embedded default), written to ``out``."""
    import transformers

    from pagedserve.engine.loader.hub import resolve_model_path
    from pagedserve.engine.models import DecoderSpec
    from pagedserve.loadtest.lora_bench import write_random_adapter

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=None)
    model = p.parse_known_args(shlex.split(server_args))[0].model
    config = transformers.AutoConfig.from_pretrained(resolve_model_path(model))
    return str(write_random_adapter(DecoderSpec.from_hf(config), out, rank=8, std=0.02))


def format_report(r: dict[str, Any]) -> str:
    lines = [f"soak: {r['duration_s']:.0f}s, {r['requests']} requests"]
    lines += [f"  {k:<24} {v}" for k, v in r["outcomes"].items()]
    if r.get("lora_ops"):
        lines.append("adapter loads and unloads: " + ", ".join(
            f"{k} {v}" for k, v in r["lora_ops"].items()))
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
    with tempfile.TemporaryDirectory(prefix="pagedserve-soak-") as tmp:
        if args.base_url:
            url, pid = args.base_url.rstrip("/"), args.server_pid
        else:
            if args.lora_path is None:
                args.lora_path = write_adapter(args.server_args, Path(tmp) / "adapter")
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
