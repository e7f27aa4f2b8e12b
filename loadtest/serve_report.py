"""The report of a ``pagedserve bench serve`` run: what was measured per request, the
summary of the requests, why a run is not clean, the text report, and the concurrency
sweep's plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class RequestResult:
    """What the client measured for one request (times in seconds)."""

    success: bool = False
    error: str = ""
    status: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    violations: list[str] = field(default_factory=list)
    text: str = ""
    reconnects: int = 0
    """Times the request was sent again because the server closed a kept-alive
    connection before answering it (the time of the failed try counts in its TTFT)."""

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1); None for a one-token output."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/median/p99 (and std) of ``values`` times ``scale`` (ms by default)."""
    import numpy as np

    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0, "std": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99)), "std": float(a.std())}


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """The benchmark report of a run (latencies in milliseconds)."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error.split(":", 1)[0] if r.error.startswith("HTTP") else r.error[:120]
        errors[key] = errors.get(key, 0) + 1
    duration = max(duration, 1e-9)
    return {
        "successful_requests": len(ok),
        "failed_requests": len(failed),
        "stream_violations": sum(1 for r in results if r.violations),
        "reconnected_requests": sum(1 for r in results if r.reconnects),
        "errors": errors,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
    }


def run_problems(report: dict[str, Any]) -> list[str]:
    """Why a run is not clean: failed requests, stream violations (empty list: clean)."""
    problems = []
    if report["failed_requests"]:
        problems.append(f"{report['failed_requests']} failed requests: "
                        f"{json.dumps(report.get('errors', {}))}")
    if report["stream_violations"]:
        problems.append(f"{report['stream_violations']} requests with stream violations")
    if report["successful_requests"] != report.get("num_prompts", report["successful_requests"]):
        problems.append(f"{report['successful_requests']} successful of "
                        f"{report['num_prompts']} requests")
    return problems


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report of one run."""
    w = 48
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w + 14, c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<{w}}{value:>14}")

    row("Successful requests:", r["successful_requests"])
    row("Failed requests:", r["failed_requests"])
    row("Requests with stream violations:", r["stream_violations"])
    if r.get("reconnected_requests"):
        row("Requests sent again (server closed the connection):", r["reconnected_requests"])
    row("Maximum request concurrency:", r.get("max_concurrency") or "-")
    row("Request rate (req/s):", r.get("request_rate", "inf"))
    row("Benchmark duration (s):", f"{r['duration_s']:.2f}")
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", f"{r['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}")
    for key, title in (("ttft_ms", "Time to First Token"),
                       ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append("{s:{c}^{n}}".format(s=f" {title} ", n=w + 14, c="-"))
        name = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize()} {name} (ms):", f"{r[key][stat]:.2f}")
    if r.get("errors"):
        lines.append("errors: " + json.dumps(r["errors"]))
    if "server_metrics" in r:
        lines.append("{s:{c}^{n}}".format(s=" Server /metrics vs client (mean, ms) ",
                                          n=w + 14, c="-"))
        for key, m in r["server_metrics"].items():
            sm = m["server_mean_ms"]
            lines.append(f"{key.upper():<6} server {sm if sm is None else f'{sm:10.2f}'}"
                         f" (n={m['server_count']})   client {m['client_mean_ms']:10.2f}")
    spec = r.get("spec_decode")
    if spec is not None:
        lines.append("{s:{c}^{n}}".format(s=" Speculative decoding ", n=w + 14, c="-"))
        rate, per_step = spec["acceptance_rate"], spec["tokens_per_speculative_step"]
        row("Draft tokens (accepted):", f"{spec['num_draft_tokens']} ({spec['num_accepted_tokens']})")
        row("Acceptance rate:", "-" if rate is None else f"{rate:.3f}")
        row("Tokens per speculative step:", "-" if per_step is None else f"{per_step:.2f}")
    lines.append("=" * (w + 14))
    return "\n".join(lines)


def plot_sweep(reports: Sequence[dict[str, Any]], path: Path, title: str = "") -> None:
    """PNG of output throughput and p99 TTFT/E2E latency against max concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["max_concurrency"] for r in reports]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(conc, [r["output_throughput"] for r in reports], "o-")
    ax1.set_xlabel("max concurrency")
    ax1.set_ylabel("output throughput (tok/s)")
    ax1.set_xscale("log", base=2)
    ax1.grid(True, alpha=0.3)
    ax2.plot(conc, [r["ttft_ms"]["p99"] for r in reports], "o-", label="p99 TTFT")
    ax2.plot(conc, [r["e2el_ms"]["p99"] for r in reports], "s-", label="p99 E2E latency")
    ax2.set_xlabel("max concurrency")
    ax2.set_ylabel("latency (ms)")
    ax2.set_xscale("log", base=2)
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
