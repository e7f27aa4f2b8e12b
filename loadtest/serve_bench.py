"""Online serving benchmark: stream requests at a running OpenAI-compatible server.

An asyncio client (aiohttp) sends ``--num-prompts`` streaming requests
(``stream_options.include_usage``) to ``/v1/completions`` or ``/v1/chat/completions``,
shaped by a Poisson request rate (``--request-rate``, gamma-distributed gaps with
``--burstiness``; ``inf`` sends everything at once) and/or ``--max-concurrency``. Every
SSE stream is validated as it arrives: exact ``data: ...`` framing, exactly one finish
chunk per choice, ``[DONE]`` last, the usage chunk present; a violation fails the request
unless ``--no-strict-streams``.

Reported: successful/failed requests, stream violations, duration, request throughput,
output and total token throughput (tokens from the server's ``usage``), and the mean,
median and p99 of TTFT (time to the first chunk with content), TPOT
((latency - TTFT) / (output tokens - 1)), ITL (gaps between content chunks) and
end-to-end latency. ``--check-metrics`` puts the server's own TTFT/E2E/ITL histogram
means for the same run next to the client's; ``--sweep 1,8,32`` repeats the run over
concurrencies and plots throughput and p99 latencies (PNG).

Example::

    pagedserve serve --port 8000 &
    pagedserve bench serve --port 8000 --dataset random --random-input-len 128 \\
        --random-output-len 64 --num-prompts 64 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.datasets import DATASETS, SampleRequest
from loadtest.serve_report import (  # noqa: F401 - part of this module's interface
    RequestResult,
    format_report,
    plot_sweep,
    run_problems,
    summarize,
)
from loadtest.server_metrics import (  # noqa: F401 - part of this module's interface
    SERVER_HISTOGRAMS,
    compare_server_metrics,
    fetch_metrics,
    histogram_mean,
    metric_total,
    server_idle_problems,
    spec_decode_summary,
    wait_server_idle,
)
from loadtest.sse_check import StreamChecker  # noqa: F401

logger = logging.getLogger("loadtest.serve_bench")

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
        res.output_tokens = count_tokens(res.text)
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


# -- command line ------------------------------------------------------------------------
def _rate(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 (or inf)")
    return v


def _concurrencies(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         "integers") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: concurrencies must be >= 1")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``pagedserve bench serve``."""
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default=None,
                   help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    s.add_argument("--model", default=None,
                   help="'model' of the requests (default: the first of GET /v1/models)")
    s.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or hub id for building prompts (default: the "
                        "embedded default model's)")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=DATASETS)
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--random-input-len", type=int, default=128)
    d.add_argument("--random-output-len", type=int, default=64)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default: %(default)s)")
    d.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of a random prefix shared by every prompt")
    d.add_argument("--prompt-as-text", action="store_true",
                   help="send random prompts to /v1/completions as decoded text instead of "
                        "token ids (for servers that take only strings)")
    d.add_argument("--conversation-output-len", type=int, default=None,
                   help="output length of every conversation or grounded request "
                        "(default: the reference reply's length)")
    d.add_argument("--seed", type=int, default=0)
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf,
                      help="requests per second, Poisson arrivals; inf sends all at once "
                           "(default: %(default)s)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps; 1 = Poisson (default: %(default)s)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight at once (default: unbounded)")
    load.add_argument("--sweep", type=_concurrencies, default=None, metavar="C1,C2,...",
                      help="repeat the run at each max concurrency and plot the results")
    load.add_argument("--plot", default=None, metavar="FILE.png",
                      help="sweep plot (default: next to --save-result, else "
                           "results/serve_sweep.png)")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="requests sent one by one before the measured run")
    r = p.add_argument_group("requests")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every output has its requested length")
    r.add_argument("--extra-body", default=None, metavar="JSON",
                   help="JSON object merged into every request body")
    r.add_argument("--strict-streams", action=argparse.BooleanOptionalAction, default=True,
                   help="count a request with a stream violation as failed")
    r.add_argument("--timeout", type=float, default=6 * 3600.0, help="per-request timeout (s)")
    o = p.add_argument_group("output")
    o.add_argument("--check-metrics", action="store_true",
                   help="compare the server's /metrics latency histograms with the client's")
    o.add_argument("--save-result", default=None, metavar="FILE.json",
                   help="write the report(s) as JSON")
    o.add_argument("--save-detailed", action="store_true",
                   help="include every request's measurements in --save-result")
    o.add_argument("--fail-on-error", action="store_true",
                   help="exit with status 1 if any request failed")


def build_samples(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The request set named by the dataset flags."""
    from loadtest.datasets import (
        conversation_dataset,
        grounded_dataset,
        random_dataset,
        vocabulary_ids,
    )

    if args.dataset == "random":
        return random_dataset(vocabulary_ids(tokenizer), args.num_prompts,
                              args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.random_prefix_len, args.seed,
                              tokenizer=tokenizer, as_text=args.prompt_as_text)
    build = grounded_dataset if args.dataset == "grounded" else conversation_dataset
    return build(tokenizer, args.num_prompts, args.seed, output_len=args.conversation_output_len)


def load_bench_tokenizer(name: str | None) -> Any:
    """The tokenizer of ``name`` (a folder or hub id), or of the embedded default model."""
    from engine.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(name))


def main(args: argparse.Namespace) -> dict[str, Any] | list[dict[str, Any]]:
    """Run ``pagedserve bench serve``; the report (a list of reports for a sweep)."""
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    if args.num_prompts < 1:
        raise SystemExit(f"error: --num-prompts={args.num_prompts} must be >= 1")
    try:
        extra = json.loads(args.extra_body) if args.extra_body else None
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --extra-body is not valid JSON: {e}") from None
    if extra is not None and not isinstance(extra, dict):
        raise SystemExit("error: --extra-body must be a JSON object")
    tokenizer = load_bench_tokenizer(args.tokenizer)
    samples = build_samples(args, tokenizer)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    concurrencies: list[int | None] = list(args.sweep) if args.sweep else [args.max_concurrency]
    reports = []
    for conc in concurrencies:
        print(f"bench serve: {len(samples)} {args.dataset} prompts -> {base_url}{args.endpoint}"
              f", max concurrency {conc or 'unbounded'}, rate {args.request_rate}",
              file=sys.stderr, flush=True)
        report = asyncio.run(run_benchmark(
            base_url, samples, endpoint=args.endpoint, model=args.model,
            request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=conc,
            seed=args.seed, temperature=args.temperature, ignore_eos=args.ignore_eos,
            extra_body=extra, strict=args.strict_streams, count_tokens=count_tokens,
            api_key=args.api_key, timeout=args.timeout, check_metrics=args.check_metrics,
            num_warmups=args.num_warmups, show_progress=True))
        report["dataset"] = args.dataset
        if args.dataset == "random":
            report["random"] = {"input_len": args.random_input_len,
                                "output_len": args.random_output_len,
                                "range_ratio": args.random_range_ratio,
                                "prefix_len": args.random_prefix_len}
        print(format_report(report), flush=True)
        if not args.save_detailed:
            report.pop("requests", None)
        reports.append(report)
    if args.sweep:
        plot = Path(args.plot) if args.plot else (
            Path(args.save_result).with_suffix(".png") if args.save_result
            else Path("results/serve_sweep.png"))
        plot_sweep(reports, plot, title=f"{reports[0]['model']} {args.endpoint} "
                                        f"({args.dataset}, {len(samples)} prompts)")
        print(f"plot: {plot}")
    result: dict[str, Any] | list[dict[str, Any]] = reports if args.sweep else reports[0]
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved: {path}")
    if args.fail_on_error and any(r["failed_requests"] for r in reports):
        raise SystemExit(1)
    return result
