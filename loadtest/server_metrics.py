"""Reading a pagedserve server's Prometheus ``/metrics``: totals, histogram means, idleness."""

from __future__ import annotations

import asyncio
import time
from typing import Any

SERVER_HISTOGRAMS = {
    "ttft": "pagedserve:time_to_first_token_seconds",
    "e2e": "pagedserve:e2e_request_latency_seconds",
    "itl": "pagedserve:inter_token_latency_seconds",
}
"""Server-side histograms compared with the client's numbers by ``--check-metrics``."""


async def fetch_metrics(session: Any, base_url: str) -> str:
    """The Prometheus text of ``GET /metrics``."""
    async with session.get(base_url + "/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


def metric_total(text: str, name: str) -> float | None:
    """The sum over label sets of sample ``name`` in a Prometheus text (None if absent)."""
    total: float | None = None
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest[:1] not in ("{", " "):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        total = value if total is None else total + value
    return total


def histogram_mean(before: str, after: str, name: str) -> tuple[float | None, int]:
    """Mean (seconds) and count of histogram ``name`` observed between two scrapes."""
    s1, c1 = metric_total(after, name + "_sum"), metric_total(after, name + "_count")
    if s1 is None or c1 is None:
        return None, 0
    s0 = metric_total(before, name + "_sum") or 0.0
    c0 = metric_total(before, name + "_count") or 0.0
    n = int(round(c1 - c0))
    return ((s1 - s0) / n if n > 0 else None), n


def compare_server_metrics(before: str, after: str, report: dict[str, Any]) -> dict[str, Any]:
    """Server histogram means over the run next to the client's means (ms)."""
    client = {"ttft": report["ttft_ms"]["mean"], "e2e": report["e2el_ms"]["mean"],
              "itl": report["itl_ms"]["mean"]}
    out: dict[str, Any] = {}
    for key, name in SERVER_HISTOGRAMS.items():
        mean, n = histogram_mean(before, after, name)
        out[key] = {"server_mean_ms": None if mean is None else mean * 1000.0,
                    "server_count": n, "client_mean_ms": client[key]}
    return out


def spec_decode_summary(before: str, after: str) -> dict[str, Any] | None:
    """Speculative decoding over the run from a pagedserve server's counters: drafts,
    draft and accepted tokens, the acceptance rate and the tokens a speculating request
    gained per step (None when the server does not count them or did not speculate)."""
    def delta(name: str) -> float | None:
        a = metric_total(after, f"pagedserve:spec_decode_{name}_total")
        if a is None:
            return None
        return a - (metric_total(before, f"pagedserve:spec_decode_{name}_total") or 0.0)

    drafts, proposed, accepted = delta("num_drafts"), delta("num_draft_tokens"), \
        delta("num_accepted_tokens")  # fmt: skip
    if drafts is None or proposed is None or accepted is None:
        return None
    return {
        "num_drafts": int(drafts), "num_draft_tokens": int(proposed),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / proposed if proposed else None,
        "tokens_per_speculative_step": 1.0 + accepted / drafts if drafts else None,
    }


def server_idle_problems(metrics_text: str) -> list[str]:
    """Why the server is not idle with an empty KV cache (empty list: it is).

    Checks ``pagedserve:kv_cache_usage_perc`` == 0 and no running or waiting request.
    """
    problems = []
    for name in ("pagedserve:kv_cache_usage_perc", "pagedserve:num_requests_running",
                 "pagedserve:num_requests_waiting"):
        v = metric_total(metrics_text, name)
        if v is None:
            problems.append(f"{name} is missing")
        elif v != 0:
            problems.append(f"{name} = {v:g} (expected 0)")
    return problems


async def wait_server_idle(base_url: str, timeout: float = 10.0) -> list[str]:
    """Poll ``/metrics`` until :func:`server_idle_problems` is empty or ``timeout`` passes;
    the last problems found."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            problems = server_idle_problems(await fetch_metrics(session, base_url.rstrip("/")))
            if not problems or time.monotonic() > deadline:
                return problems
            await asyncio.sleep(0.2)


