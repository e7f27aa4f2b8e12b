"""``pagedserve bench BENCHMARK``: the benchmarks as subcommands.

Each benchmark is a module exposing ``add_arguments(parser)`` and ``main(args)``;
adding one is one line in :data:`BENCHMARKS`.
"""

from __future__ import annotations

import argparse
import importlib
import logging

BENCHMARKS: list[tuple[str, str, str]] = [
    ("throughput", "pagedserve.loadtest.throughput",
     "offline throughput on a random workload, matrix-product floor, --compare-hf"),
    ("prefix", "pagedserve.loadtest.prefix_bench",
     "prefix caching on/off on a shared-prefix and a zero-reuse workload"),
    ("decode", "pagedserve.loadtest.decode_bench",
     "decode latency per step at a few batch sizes, bytes read against the read bandwidth"),
    ("score", "pagedserve.loadtest.score_bench",
     "scoring and embedding prompts: prompt tokens/s with prompt logprobs and as "
     "embeddings, against plain prefill"),
    ("perplexity", "pagedserve.loadtest.perplexity_bench",
     "perplexity of a text in chunks, int8 against float activations (and KV cache "
     "types), beside llama.cpp's llama-perplexity"),
    ("priority", "pagedserve.loadtest.priority_bench",
     "a batch job and interactive requests under fcfs and priority scheduling"),
    ("lora", "pagedserve.loadtest.lora_bench",
     "the same workload on the base model and spread over k LoRA adapters"),
    ("memory", "pagedserve.loadtest.memory_bench",
     "a GGUF file's resident weights against its tensor bytes; the KV cache of one long "
     "request on a sliding-window model against a full-attention cache"),
    ("serve", "pagedserve.loadtest.serve_bench_cli",
     "online serving: streaming requests at a running server (TTFT, TPOT, ITL, throughput)"),
    ("health", "pagedserve.loadtest.health_bench",
     "/health latency while a running server prepares requests near the body limit"),
    ("soak", "pagedserve.loadtest.soak",
     "a long run of mixed traffic, disconnects, bad requests and bursts; what leaked"),
]
"""(name, module, help) of every benchmark, in ``--help`` order."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` and one sub-subcommand per benchmark."""
    p = subparsers.add_parser("bench", help="run a benchmark",
                              description="Benchmarks of the engine.")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error", "critical"])
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name, help_text in BENCHMARKS:
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=help_text, description=(module.__doc__ or "").strip(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(_bench_main=module.main)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; the process exit status."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    args._bench_main(args)
    return 0
