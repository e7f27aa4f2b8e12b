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
import math
import sys
from pathlib import Path
from typing import Any

from pagedserve.loadtest.datasets import DATASETS, SampleRequest
from pagedserve.loadtest.serve_bench import ENDPOINTS, format_report, plot_sweep, run_benchmark


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
    from pagedserve.loadtest.datasets import (
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
    from pagedserve.engine.loader import load_tokenizer, resolve_model_path

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
