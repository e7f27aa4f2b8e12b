"""Measure ``GET /health`` latency while N streams are generating.

Shows that the event loop never waits on a model step. Starts its own server (default
model, CPU settings as in the tests) unless ``--url`` is given::

    python scripts/health_latency.py --streams 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

import aiohttp
import requests

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout: tests.helpers

from tests.helpers.server import ServerProcess  # noqa: E402

logger = logging.getLogger("health_latency")

SERVER_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
               "--max-model-len", "2048", "--log-level", "warning"]


async def _stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": f"Tell story number {i}."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    n = 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content":"' in line:
                n += 1
    return n


def _probe(url: str, stop: threading.Event, started: threading.Event,
           out: list[float], interval: float) -> None:
    s = requests.Session()
    started.wait()
    while not stop.is_set():
        t0 = time.perf_counter()
        r = s.get(url + "/health", timeout=10)
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200
        time.sleep(interval)


async def _run(url: str, streams: int, max_tokens: int, interval: float) -> None:
    lat: list[float] = []
    stop, started = threading.Event(), threading.Event()
    prober = threading.Thread(target=_probe, args=(url, stop, started, lat, interval))
    prober.start()
    idle: list[float] = []
    s = requests.Session()
    for _ in range(50):
        t0 = time.perf_counter()
        s.get(url + "/health")
        idle.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(_stream(session, url, i, max_tokens))
                 for i in range(streams)]
        await asyncio.sleep(1.0)  # let prefill start: probe while decoding
        started.set()
        counts = await asyncio.gather(*tasks)
    stop.set()
    prober.join()
    dt = time.perf_counter() - t0
    lat_ms = sorted(x * 1e3 for x in lat)
    p = lambda q: lat_ms[min(len(lat_ms) - 1, int(q * len(lat_ms)))]  # noqa: E731
    logger.info("idle /health median %.2f ms", statistics.median(idle) * 1e3)
    logger.info("%d streams, %d content chunks in %.1fs (%.1f chunks/s)",
                streams, sum(counts), dt, sum(counts) / dt)
    logger.info("/health under load: n=%d median %.2f ms, p90 %.2f ms, p99 %.2f ms, max %.2f ms",
                len(lat_ms), statistics.median(lat_ms), p(0.9), p(0.99), lat_ms[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server (default: start one)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between probes")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.url:
        asyncio.run(_run(args.url, args.streams, args.max_tokens, args.interval))
        return
    with ServerProcess(SERVER_ARGS) as srv:
        asyncio.run(_run(srv.url, args.streams, args.max_tokens, args.interval))


if __name__ == "__main__":
    main()
