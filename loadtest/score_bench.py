"""Scoring benchmark: ``pagedserve bench score``.

What evaluation harnesses and retrieval ask of an engine: compute prompts and give back
each prompt token's logprob (``SamplingParams(max_tokens=0, prompt_logprobs=k)``, the
server's ``echo`` with ``logprobs`` and ``max_tokens: 0``), or their embedding
(``LLM.embed``, ``/v1/embeddings``). Random prompts of ``--input-len`` tokens, prefix
caching off, each run on the same engine with prompt logprobs off (plain prefill), with
only each token's own (``0``), with the top ``--top-k``, and as last-token and mean-pooled
embeddings; the runs alternate ``--repeats`` times. Reports prompt tokens per second
(best of the repeats) and each run's time over plain prefill's: the cost of the extra
rows' logits (``lm_head`` over every prompt position), their log-softmax and top-k, or of
the pooling.

Also runnable as ``python -m pagedserve.loadtest.score_bench``.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from pagedserve.loadtest.bench_common import (
    add_engine_args,
    apply_threads,
    command_line,
    engine_kwargs,
    environment_info,
    module_cli,
    print_header,
    save_report,
    vocab_token_ids,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench score``."""
    w = parser.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=32)
    w.add_argument("--input-len", type=int, default=512)
    w.add_argument("--top-k", type=int, default=5, help="candidates per prompt token")
    w.add_argument("--repeats", type=int, default=2, help="rounds of the three runs")
    w.add_argument("--save-result", metavar="FILE.json", default=None)
    add_engine_args(parser)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the three kinds of request in alternation; print and return the report."""

    from pagedserve import LLM, PoolingParams, SamplingParams

    apply_threads(args)
    env = environment_info()
    llm = LLM(**engine_kwargs(args, enable_prefix_caching=False))
    rng = random.Random(args.seed)
    ids = vocab_token_ids(llm)
    prompts = [{"prompt_token_ids": rng.choices(ids, k=args.input_len)}
               for _ in range(args.num_requests)]
    tokens = args.num_requests * args.input_len
    runs = {"plain prefill": None, "prompt_logprobs=0": 0,
            f"prompt_logprobs={args.top_k}": args.top_k, "embed (last token)": "LAST",
            "embed (mean)": "MEAN"}
    worker = llm.engine.worker
    print_header("pagedserve bench score", env, {
        "model": f"{worker.settings.model_name} ({worker.settings.model_path})",
        "dtype": str(worker.settings.dtype).removeprefix("torch."),
        "workload": f"{args.num_requests} random prompts x {args.input_len} tokens, "
                    f"max_tokens=0, prefix caching off, {args.repeats} rounds",
    })

    def run(k: int | str | None) -> float:
        t0 = time.perf_counter()
        if isinstance(k, str):
            outs = llm.embed(prompts, PoolingParams(pooling_type=k), use_tqdm=False)
            elapsed = time.perf_counter() - t0
            if {len(o.embedding) for o in outs} != {worker.spec.hidden_size}:
                raise RuntimeError("an embedding of the wrong length")
            return elapsed
        sp = SamplingParams(max_tokens=0, prompt_logprobs=k)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        want = None if k is None else args.input_len
        got = {None if o.prompt_logprobs is None else len(o.prompt_logprobs) for o in outs}
        if got != {want}:
            raise RuntimeError(f"prompt logprobs of {got} entries, expected {want}")
        return elapsed

    run(None)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, k in runs.items():
            times[name].append(run(k))
    base = min(times["plain prefill"])
    report: dict[str, Any] = {"benchmark": "score", "command": command_line(),
                              "environment": env, "prompt_tokens": tokens, "runs": {}}
    for name, ts in times.items():
        best = min(ts)
        report["runs"][name] = {"seconds": ts, "prompt_tok_per_s": tokens / best,
                                "time_over_plain": best / base}
        print(f"{name:<20} {tokens / best:9.0f} prompt tok/s  ({best / base:.2f}x plain; "
              f"runs {', '.join(f'{t:.2f}' for t in ts)} s)")
    save_report(args.save_result, report)
    return report


if __name__ == "__main__":
    raise SystemExit(module_cli("python -m pagedserve.loadtest.score_bench", __doc__, add_arguments, main))
