"""The online serving benchmark's client: streaming requests at a running
OpenAI-compatible server, every stream checked as it arrives, and the report.
``pagedserve bench serve`` (:mod:`pagedserve.loadtest.serve_bench_cli`) is its command line."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from pagedserve.loadtest.datasets import SampleRequest
from pagedserve.loadtest.serve_report import (  # noqa: F401 - part of this module's interface
    RequestResult,
    format_report,
    plot_sweep,
    run_problems,
    summarize,
)
from pagedserve.loadtest.server_metrics import (  # noqa: F401 - part of this module's interface
    SERVER_HISTOGRAMS,
    compare_server_metrics,
    fetch_metrics,
    histogram_mean,
    metric_total,
    server_idle_problems,
    spec_decode_summary,
    wait_server_idle,
)
from pagedserve.loadtest.sse_check import StreamChecker  # noqa: F401

logger = logging.getLogger("pagedserve.loadtest.serve_bench")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")



def build_payload(sample: SampleRequest, endpoint: str, model: str, *, temperature: float = 0.0,
                  ignore_eos: bool = True, extra_body: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The JSON body of a streaming request for ``sample``."""
    body: dict[str, Any] = {"model": model, "max_tokens": sample.expected_output_len,
                            "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint.endswith("/chat/completions"):
        if not sample.messages:
            raise ValueError("the chat endpoint needs messages (load the dataset with a "
                             "tokenizer)")
        body["messages"] = sample.messages
    else:
        body["prompt"] = sample.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    return body


async def send_request(session: Any, url: str, payload: dict[str, Any], *,
                       prompt_len: int = 0, strict: bool = True,
                       count_tokens: Any | None = None,
                       headers: dict[str, str] | None = None) -> RequestResult:
    """POST one streaming request and validate its stream; never raises.

    ``count_tokens(text) -> int`` counts output tokens when the server reports no usage
    (otherwise the number of content chunks is used). With ``strict`` a stream violation
    fails the request.
    """
    import aiohttp

    res = RequestResult(prompt_tokens=prompt_len)
    checker = StreamChecker(expected_choices=int(payload.get("n", 1)),
                            expect_usage=bool((payload.get("stream_options") or {})
                                              .get("include_usage")))
    res.start = start = time.perf_counter()
    while True:
        try:
            async with session.post(url, json=payload, headers=headers) as resp:
                res.status = resp.status
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    res.error = f"HTTP {resp.status}: {body}"
                    res.latency = time.perf_counter() - start
                    return res
                async for data in resp.content.iter_any():
                    checker.feed(data, time.perf_counter())
            res.latency = time.perf_counter() - start
            break
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            # A kept-alive connection the server had closed before it answered (llama.cpp's
            # server closes them after a few requests: the request's body cannot be
            # written, or no answer comes): sent again, once, on a new one.
            if res.status or res.reconnects:
                res.latency = time.perf_counter() - start
                res.error = f"{type(e).__name__}: {e}"
                return res
            res.reconnects += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            res.latency = time.perf_counter() - start
            res.error = f"{type(e).__name__}: {e}"
            return res
    res.violations = checker.close()
    res.text = checker.text
    times = checker.content_times
    if times:
        res.ttft = times[0] - start
        res.itl = [b - a for a, b in zip(times, times[1:], strict=False)]
    usage = checker.usage or {}
    if usage.get("completion_tokens") is not None:
        res.usage_reported = True
        res.output_tokens = int(usage["completion_tokens"])
        res.prompt_tokens = int(usage.get("prompt_tokens") or prompt_len)
    elif count_tokens is not None:
        res.output_tokens = count_tokens(checker.reasoning + res.text)
    else:
        res.output_tokens = len(times)
    if checker.error is not None:
        res.error = f"error event: {checker.error}"
    elif not times:
        res.error = "no chunk carried content"
    elif strict and res.violations:
        res.error = "stream violation: " + "; ".join(res.violations)
    else:
        res.success = True
    return res


# -- a whole run -------------------------------------------------------------------------
def arrival_gaps(n: int, request_rate: float, burstiness: float = 1.0,
                 seed: int = 0) -> list[float]:
    """Seconds to wait before each of ``n`` requests.

    Gamma-distributed with shape ``burstiness`` and mean ``1 / request_rate`` (shape 1 is
    a Poisson process; smaller is burstier); all zeros for an infinite rate.
    """
    if request_rate <= 0:
        raise ValueError(f"request rate {request_rate} must be > 0")
    if burstiness <= 0:
        raise ValueError(f"burstiness {burstiness} must be > 0")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def run_benchmark(
    base_url: str,
    samples: Sequence[SampleRequest],
    *,
    endpoint: str = "/v1/completions",
    model: str | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
    strict: bool = True,
    count_tokens: Any | None = None,
    api_key: str | None = None,
    timeout: float = 6 * 3600,
    check_metrics: bool = False,
    num_warmups: int = 0,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Run the benchmark against ``base_url``; the report of :func:`summarize` plus the run's
    parameters, the per-request results (``"requests"``) and, with ``check_metrics``, the
    server-side comparison (``"server_metrics"``).
    """
    import aiohttp

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=client_timeout,
                                     headers=headers) as session:
        if model is None:
            model = await fetch_model_name(session, base_url)
        url = base_url + endpoint

        async def one(sample: SampleRequest) -> RequestResult:
            payload = build_payload(sample, endpoint, model, temperature=temperature,
                                    ignore_eos=ignore_eos, extra_body=extra_body)
            return await send_request(session, url, payload, prompt_len=sample.prompt_len,
                                      strict=strict, count_tokens=count_tokens)

        for sample in list(samples)[:num_warmups]:
            await one(sample)
        before = await _try_metrics(session, base_url)

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        gaps = arrival_gaps(len(samples), request_rate, burstiness, seed)
        done_count = 0

        async def limited(sample: SampleRequest) -> RequestResult:
            nonlocal done_count
            if sem is None:
                r = await one(sample)
            else:
                async with sem:
                    r = await one(sample)
            done_count += 1
            if show_progress and (done_count % max(1, len(samples) // 10) == 0
                                  or done_count == len(samples)):
                print(f"  {done_count}/{len(samples)} done", file=sys.stderr, flush=True)
            return r

        tasks = []
        t0 = time.perf_counter()
        for sample, gap in zip(samples, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(sample)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0

        report = summarize(results, duration)
        report.update({
            "base_url": base_url, "endpoint": endpoint, "model": model,
            "num_prompts": len(samples),
            "request_rate": "inf" if math.isinf(request_rate) else request_rate,
            "burstiness": burstiness, "max_concurrency": max_concurrency,
            "strict_streams": strict,
        })
        after = await _try_metrics(session, base_url)
        if check_metrics:
            if after is None:
                raise RuntimeError(f"--check-metrics: {base_url}/metrics did not answer")
            report["server_metrics"] = compare_server_metrics(before or "", after, report)
        spec = spec_decode_summary(before or "", after) if after is not None else None
        if spec is not None:
            report["spec_decode"] = spec
    report["requests"] = [asdict(r) | {"tpot": r.tpot} for r in results]
    return report


async def _try_metrics(session: Any, base_url: str) -> str | None:
    """``/metrics`` of the server, or None when it has none (another server)."""
    try:
        return await fetch_metrics(session, base_url)
    except Exception:  # noqa: BLE001 - any server without pagedserve's metrics
        return None


async def fetch_model_name(session: Any, base_url: str) -> str:
    """The first model id of ``GET /v1/models``."""
    import aiohttp

    try:
        async with session.get(base_url + "/v1/models") as resp:
            resp.raise_for_status()
            data = await resp.json()
        return data["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, KeyError, IndexError,
            TypeError, ValueError) as e:
        raise SystemExit(f"error: could not read the model name from {base_url}/v1/models "
                         f"({type(e).__name__}: {e}); is the server up? (or pass --model)") from None
