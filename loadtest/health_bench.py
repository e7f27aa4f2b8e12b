"""``/health`` latency benchmark: ``pagedserve bench health``.

Against a running server (``--url``): each kind of large request (a long message, many
empty messages, a prompt of token ids, many such prompts, ``/detokenize`` of many ids,
``/tokenize`` of a long text; each near the 4 MiB body limit) is sent ``--repeats``
times while ``/health`` is polled every ``--interval`` seconds; reports, per kind, the
request's time and ``/health``'s median and slowest answer. The server prepares such
requests off its event loop, so ``/health`` should answer in a few milliseconds
throughout (the server tests check where the work runs; this measures how fast).

Also runnable as ``python -m pagedserve.loadtest.health_bench``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

from pagedserve.loadtest.bench_common import module_cli, save_report


def _ids(n: int) -> list[int]:
    return [1000 + i % 30000 for i in range(n)]


def heavy_requests() -> dict[str, tuple[str, dict[str, Any]]]:
    """``kind -> (route, body)`` of the large requests."""
    chat = "/v1/chat/completions"
    return {
        "empty_messages": (chat, {"messages": [{"role": "user", "content": ""}] * 120000,
                                  "max_tokens": 1}),
        "long_message": (chat, {"messages": [{"role": "user", "content": "hello " * 600000}]}),
        "token_id_prompt": ("/v1/completions", {"prompt": _ids(500000)}),
        "many_token_id_prompts": ("/v1/completions", {"prompt": [_ids(2040)] * 256}),
        "detokenize": ("/detokenize", {"tokens": _ids(500000)}),
        "tokenize": ("/tokenize", {"prompt": "hello " * 600000}),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench health``."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.01,
                        help="seconds between /health polls")
    parser.add_argument("--kinds", default=",".join(heavy_requests()),
                        help="comma-separated kinds of request")
    parser.add_argument("--save-result", metavar="FILE.json", default=None)


def measure(url: str, route: str, body: bytes, headers: dict[str, str],
            interval: float) -> tuple[float, int, list[float]]:  # fmt: skip
    """Send ``body`` to ``route`` while polling ``/health``: the request's seconds and
    status, and every ``/health`` latency (seconds)."""
    import requests

    done = threading.Event()
    out: dict[str, Any] = {}

    def send() -> None:
        t0 = time.perf_counter()
        try:
            out["status"] = requests.post(url + route, data=body, timeout=600, headers={
                "Content-Type": "application/json", **headers}).status_code
        finally:
            out["took"] = time.perf_counter() - t0
            done.set()

    sender = threading.Thread(target=send)
    sender.start()
    latencies = []
    with requests.Session() as s:
        while not done.is_set():
            t0 = time.perf_counter()
            s.get(url + "/health", timeout=600)
            latencies.append(time.perf_counter() - t0)
            time.sleep(interval)
    sender.join()
    return out["took"], out["status"], latencies


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every kind; print and return the report."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    requests_ = heavy_requests()
    report: dict[str, Any] = {"url": args.url, "kinds": {}}
    print(f"{'kind':<22} {'status':>6} {'request s':>10} {'/health p50 ms':>15} "
          f"{'/health max ms':>15}")
    for kind in args.kinds.split(","):
        route, obj = requests_[kind]
        body = json.dumps(obj).encode()
        runs = [measure(args.url, route, body, headers, args.interval)
                for _ in range(args.repeats)]
        lat = [x for _, _, ls in runs for x in ls]
        row = {"route": route, "body_bytes": len(body), "status": runs[0][1],
               "request_s": statistics.median(t for t, _, _ in runs),
               "health_p50_ms": statistics.median(lat) * 1e3 if lat else None,
               "health_max_ms": max(lat) * 1e3 if lat else None, "health_polls": len(lat)}
        report["kinds"][kind] = row
        p50, worst = row["health_p50_ms"], row["health_max_ms"]
        print(f"{kind:<22} {row['status']:>6} {row['request_s']:>10.2f} "
              f"{p50 if p50 is not None else float('nan'):>15.1f} "
              f"{worst if worst is not None else float('nan'):>15.1f}")
    save_report(args.save_result, report)
    return report


if __name__ == "__main__":
    raise SystemExit(module_cli("python -m pagedserve.loadtest.health_bench", __doc__,
                                add_arguments, main))
