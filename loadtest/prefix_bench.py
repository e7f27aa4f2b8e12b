"""Prefix-cache benchmark: ``pagedserve bench prefix``.

Two workloads, each run with prefix caching on and off on a fresh engine:

* shared prefix: every request is one system prompt plus a distinct question, so with
  caching on the system prompt is computed once;
* zero reuse: random prompts sharing nothing, so caching can only cost (hashing every
  full block, cache lookups). Repeated ``--repeats`` times alternating on/off to beat
  timing noise.

With ``--restart``, the KV block store's scenario runs instead
(:mod:`pagedserve.loadtest.prefix_restart`): a long document's TTFT cold, as a pool hit,
after a restart and after competing traffic evicted it, and a zero-reuse workload with
and without the store.

Reports total time, prefill tokens computed (prompt tokens minus those served from the
cache, from ``RequestOutput.num_cached_tokens``), hit rate and peak blocks used, and the
ratios off/on. ``--profile-hashing`` runs the zero-reuse workload with caching on under
cProfile and lists the prefix-caching functions and their share of the run.

Also runnable as ``python -m pagedserve.loadtest.prefix_bench``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import logging
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from pagedserve.loadtest import prefix_restart
from pagedserve.loadtest.bench_common import (
    EngineRun,
    add_engine_args,
    apply_threads,
    command_line,
    engine_kwargs,
    environment_info,
    module_cli,
    print_header,
    run_engine,
    save_report,
    vocab_token_ids,
    warm_up,
)
from pagedserve.loadtest.workloads import Workload, fixed_workload, shared_prefix_workload

logger = logging.getLogger("pagedserve.loadtest")

# Functions on the prefix-caching path, reported by --profile-hashing.
_HASH_PATH = ("blockmgr/",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench prefix``."""
    w = parser.add_argument_group("workloads")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--prefix-len", type=int, default=512, help="shared system prompt tokens")
    w.add_argument("--question-len", type=int, default=32, help="distinct suffix tokens")
    w.add_argument("--output-len", type=int, default=32)
    w.add_argument("--zero-reuse-input-len", type=int, default=256)
    w.add_argument("--zero-reuse-output-len", type=int, default=32)
    add_engine_args(parser)
    r = parser.add_argument_group("run")
    r.add_argument("--repeats", "--repeat", dest="repeats", type=int, default=3,
                   help="zero-reuse on/off pairs, alternating (the shared-prefix pair runs once)")
    r.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--profile-hashing", action="store_true",
                   help="cProfile the zero-reuse run with caching on")
    r.add_argument("--save-result", metavar="FILE.json", default=None)
    prefix_restart.add_arguments(parser)


def _fresh_llm(args: argparse.Namespace, caching: bool):
    from pagedserve.engine.loop.llm import LLM

    return LLM(model=args.model, **engine_kwargs(args, enable_prefix_caching=caching))


def _run(args, caching: bool, workload: Workload, token_ids: list[int],
         profile: cProfile.Profile | None = None) -> EngineRun:
    llm = _fresh_llm(args, caching)
    if args.warmup:
        warm_up(llm, token_ids, args.seed)
    if profile is not None:
        profile.enable()
    try:
        run = run_engine(llm, workload)
    finally:
        if profile is not None:
            profile.disable()
    del llm
    gc.collect()
    return run


def _row(label: str, run: EngineRun) -> str:
    return (f"{label:<22} {run.elapsed_s:8.2f} s  prefill computed {run.num_prefill_computed:6d}"
            f" / {run.num_prompt_tokens:6d}  hit rate {100 * run.hit_rate:5.1f}%  peak blocks "
            f"{run.peak_blocks_used:5d}  out {run.num_output_tokens}")


def hashing_profile(profile: cProfile.Profile, elapsed_s: float, top: int = 12) -> dict[str, Any]:
    """The prefix-cache functions' self and cumulative time, largest cumulative first."""
    st = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        if any(p in path for p in _HASH_PATH) or name in ("blake2b", "digest", "update"):
            short = path.split("/main/")[-1] if "/main/" in path else path
            rows.append({"function": f"{short}:{line}({name})", "calls": nc,
                         "self_s": tt, "cumulative_s": ct})
    rows.sort(key=lambda r: r["cumulative_s"], reverse=True)

    def cum(*names: str) -> float:
        return sum(r["cumulative_s"] for r in rows if r["function"].endswith(names))

    path_s = cum("(get_computed_blocks)", "(_hash_full_blocks)")
    hash_s = cum("(hash_block_tokens)")
    return {
        "elapsed_s_profiled": elapsed_s,
        "prefix_cache_path_s": path_s,
        "prefix_cache_path_share": path_s / elapsed_s if elapsed_s else 0.0,
        "hash_block_tokens_s": hash_s,
        "hash_block_tokens_share": hash_s / elapsed_s if elapsed_s else 0.0,
        "functions": rows[:top],
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run both workloads with caching on and off; print and return the report."""
    apply_threads(args)
    env = environment_info()
    probe = _fresh_llm(args, True)
    token_ids = vocab_token_ids(probe)
    worker = probe.engine.worker
    model_desc = f"{worker.settings.model_name} ({worker.settings.model_path})"
    dtype = str(worker.settings.dtype).removeprefix("torch.")
    del probe, worker
    gc.collect()
    if args.restart:
        print_header("pagedserve bench prefix --restart", env, {
            "model": model_desc, "dtype": dtype, "seed": args.seed,
            "document": (f"{args.doc_len} tokens + {args.restart_question_len}-token "
                         f"question, {args.restart_output_len} output tokens"),
            "zero":     (f"{args.num_requests} requests x {args.zero_reuse_input_len} random "
                         f"tokens, {args.zero_reuse_output_len} output tokens, "
                         f"{args.repeats} pairs with and without the store"),
        })
        report = {"benchmark": "prefix-restart", "command": command_line(),
                  "environment": env, "model": model_desc, "dtype": dtype,
                  "seed": args.seed, **prefix_restart.run_restart(args, token_ids)}
        if save_report(args.save_result, report):
            print(f"saved {args.save_result}")
        return report
    shared = shared_prefix_workload(token_ids, args.num_requests, args.prefix_len,
                                    args.question_len, args.output_len, args.seed)
    zero = fixed_workload(token_ids, args.num_requests, args.zero_reuse_input_len,
                          args.zero_reuse_output_len, args.seed + 1)
    print_header("pagedserve bench prefix", env, {
        "model": model_desc, "dtype": dtype, "seed": args.seed,
        "shared": (f"{args.num_requests} requests = {args.prefix_len}-token shared prefix + "
                   f"{args.question_len}-token question, {args.output_len} output tokens"),
        "zero":   (f"{args.num_requests} requests x {args.zero_reuse_input_len} random "
                   f"tokens, {args.zero_reuse_output_len} output tokens, "
                   f"{args.repeats} on/off pairs"),
    })

    report: dict[str, Any] = {
        "benchmark": "prefix", "command": command_line(), "environment": env,
        "model": model_desc, "dtype": dtype, "seed": args.seed,
        "workloads": {"shared_prefix": shared.summary(), "zero_reuse": zero.summary()},
    }
    print("-- shared prefix --")
    on = _run(args, True, shared, token_ids)
    print(_row("caching on", on))
    off = _run(args, False, shared, token_ids)
    print(_row("caching off", off))
    sp = {
        "on": on.summary(), "off": off.summary(),
        "prefill_tokens_off_over_on": off.num_prefill_computed / max(on.num_prefill_computed, 1),
        "time_off_over_on": off.elapsed_s / on.elapsed_s,
    }
    print(f"ratios: prefill tokens off/on {sp['prefill_tokens_off_over_on']:.2f}x, "
          f"time off/on {sp['time_off_over_on']:.2f}x")
    report["shared_prefix"] = sp

    print("-- zero reuse --")
    pairs = []
    for i in range(args.repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {}
        for caching in order:
            got[caching] = _run(args, caching, zero, token_ids)
            print(_row(f"#{i + 1} caching {'on' if caching else 'off'}", got[caching]))
        pairs.append((got[True], got[False]))
    costs = [a.elapsed_s / b.elapsed_s - 1.0 for a, b in pairs]
    t_on = sum(a.elapsed_s for a, _ in pairs)
    t_off = sum(b.elapsed_s for _, b in pairs)
    zr = {
        "runs": [{"on": a.summary(), "off": b.summary()} for a, b in pairs],
        "cost_per_pair": costs,
        "cost_median": statistics.median(costs),
        "cost_total_time": t_on / t_off - 1.0,
    }
    print(f"zero-reuse cost of caching on: median {100 * zr['cost_median']:+.2f}% over "
          f"{len(costs)} pairs (per pair: "
          + ", ".join(f"{100 * c:+.2f}%" for c in costs)
          + f"); summed time {100 * zr['cost_total_time']:+.2f}%")
    report["zero_reuse"] = zr

    if args.profile_hashing:
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        run = _run(args, True, zero, token_ids, prof)
        hp = hashing_profile(prof, run.elapsed_s)
        hp["wall_s_with_profiler"] = time.perf_counter() - t0
        top = hp["functions"]
        print("-- prefix-caching path under cProfile (zero reuse, caching on) --")
        print(f"profiled run: {run.elapsed_s:.2f} s; lookups + block hashing "
              f"(get_computed_blocks + _hash_full_blocks) {hp['prefix_cache_path_s']:.4f} s = "
              f"{100 * hp['prefix_cache_path_share']:.3f}% of it, of which hash_block_tokens "
              f"{hp['hash_block_tokens_s']:.4f} s")
        for r in top:
            print(f"  {r['cumulative_s']:8.4f} s cum  {r['self_s']:8.4f} s self  "
                  f"{r['calls']:8d} calls  {r['function']}")
        report["hashing_profile"] = hp

    if save_report(args.save_result, report):
        print(f"saved {args.save_result}")
    return report


def cli(argv: Sequence[str] | None = None) -> int:
    return module_cli("python -m pagedserve.loadtest.prefix_bench", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
