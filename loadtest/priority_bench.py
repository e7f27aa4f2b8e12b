"""Priority benchmark: ``pagedserve bench priority``.

A batch job and interactive requests on one engine. ``--batch-requests`` random prompts
(``--batch-input-len`` tokens, ``--batch-output-len`` out, priority 10) fill the seats
(``--max-num-seqs``); after ``--delay-steps`` engine steps, ``--interactive-requests``
short ones arrive (priority -1). The same workload runs under ``scheduling_policy``
``fcfs`` (priorities ignored) and ``priority``, each on its own engine, and the report
compares the interactive requests' time to first token and end-to-end time, the batch's
completion time, and the preemptions each policy paid for them.

Also runnable as ``python -m pagedserve.loadtest.priority_bench``.
"""

from __future__ import annotations

import argparse
import random
import statistics
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

BATCH_PRIORITY, INTERACTIVE_PRIORITY = 10, -1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench priority``."""
    w = parser.add_argument_group("workload")
    w.add_argument("--batch-requests", type=int, default=24)
    w.add_argument("--batch-input-len", type=int, default=256)
    w.add_argument("--batch-output-len", type=int, default=96)
    w.add_argument("--interactive-requests", type=int, default=4)
    w.add_argument("--interactive-input-len", type=int, default=48)
    w.add_argument("--interactive-output-len", type=int, default=16)
    w.add_argument("--delay-steps", type=int, default=8,
                   help="engine steps of the batch before the interactive requests arrive")
    w.add_argument("--save-result", metavar="FILE.json", default=None)
    add_engine_args(parser)
    parser.set_defaults(max_num_seqs=8)


def _run(llm, prompts: list[list[int]], args: argparse.Namespace,
         by_priority: bool) -> dict[str, Any]:
    from pagedserve import SamplingParams
    from pagedserve.engine.loop.llm_engine import OUTPUT_DELTA

    eng = llm.engine
    n_batch = args.batch_requests

    def params(k: int) -> SamplingParams:
        batch = k < n_batch
        prio = (BATCH_PRIORITY if batch else INTERACTIVE_PRIORITY) if by_priority else 0
        return SamplingParams(temperature=0, ignore_eos=True, priority=prio, max_tokens=(
            args.batch_output_len if batch else args.interactive_output_len))

    preempted_before = eng.scheduler.num_preemptions
    t0 = time.perf_counter()
    for k in range(n_batch):
        eng.add_request(f"b{k}", prompts[k], params(k), output_kind=OUTPUT_DELTA)
    finished: dict[str, Any] = {}
    first_step: dict[str, int] = {}
    """Interactive request -> engine steps from its arrival to its first token."""
    steps = 0
    while eng.has_unfinished_requests() or steps <= args.delay_steps:
        if steps == args.delay_steps:
            for k in range(n_batch, len(prompts)):
                eng.add_request(f"i{k}", prompts[k], params(k), output_kind=OUTPUT_DELTA)
        for out in eng.step():
            rid = out.request_id
            if rid[0] == "i" and rid not in first_step and out.outputs[0].token_ids:
                first_step[rid] = steps - args.delay_steps + 1
            if out.finished:
                finished[rid] = out
        steps += 1
    wall = time.perf_counter() - t0
    inter = [o.metrics for rid, o in finished.items() if rid.startswith("i")]
    batch_end = max(o.metrics.finished_time for rid, o in finished.items()
                    if rid.startswith("b"))
    ttft = [m.time_to_first_token for m in inter]
    e2e = [m.finished_time - m.arrival_time for m in inter]
    return {"interactive_ttft_s": {"mean": statistics.fmean(ttft), "max": max(ttft)},
            "interactive_ttft_steps": sorted(first_step.values()),
            "interactive_e2e_s": {"mean": statistics.fmean(e2e), "max": max(e2e)},
            "batch_done_s": batch_end - min(o.metrics.arrival_time for rid, o in
                                            finished.items() if rid.startswith("b")),
            "wall_s": wall, "steps": steps,
            "preemptions": eng.scheduler.num_preemptions - preempted_before}


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload under both policies; print and return the report."""
    from pagedserve import LLM

    apply_threads(args)
    env = environment_info()
    rng = random.Random(args.seed)
    report: dict[str, Any] = {"benchmark": "priority", "command": command_line(),
                              "environment": env, "policies": {}}
    prompts: list[list[int]] | None = None
    for policy in ("fcfs", "priority"):
        llm = LLM(**engine_kwargs(args, scheduling_policy=policy))
        if prompts is None:
            ids = vocab_token_ids(llm)
            prompts = ([rng.choices(ids, k=args.batch_input_len)
                        for _ in range(args.batch_requests)]
                       + [rng.choices(ids, k=args.interactive_input_len)
                          for _ in range(args.interactive_requests)])
            worker = llm.engine.worker
            print_header("pagedserve bench priority", env, {
                "model": f"{worker.settings.model_name} ({worker.settings.model_path})",
                "dtype": str(worker.settings.dtype).removeprefix("torch."),
                "workload": f"{args.batch_requests} batch requests {args.batch_input_len}"
                            f"->{args.batch_output_len} (priority {BATCH_PRIORITY}); after "
                            f"{args.delay_steps} steps {args.interactive_requests} "
                            f"interactive {args.interactive_input_len}->"
                            f"{args.interactive_output_len} (priority "
                            f"{INTERACTIVE_PRIORITY}); max_num_seqs {args.max_num_seqs}",
            })
        _run(llm, prompts[:1] + prompts[-1:], _warm_args(args), policy == "priority")
        r = report["policies"][policy] = _run(llm, prompts, args, policy == "priority")
        print(f"{policy:<9} interactive TTFT mean {r['interactive_ttft_s']['mean']:6.2f} s "
              f"max {r['interactive_ttft_s']['max']:6.2f} s | interactive E2E mean "
              f"{r['interactive_e2e_s']['mean']:6.2f} s | batch done {r['batch_done_s']:6.2f} "
              f"s | {r['preemptions']} preemptions | interactive first tokens after "
              f"{r['interactive_ttft_steps']} steps")
        del llm
    f, p = report["policies"]["fcfs"], report["policies"]["priority"]
    report["interactive_ttft_fcfs_over_priority"] = (f["interactive_ttft_s"]["mean"]
                                                     / p["interactive_ttft_s"]["mean"])
    report["batch_done_priority_over_fcfs"] = p["batch_done_s"] / f["batch_done_s"]
    print(f"interactive TTFT: fcfs / priority = "
          f"{report['interactive_ttft_fcfs_over_priority']:.1f}x; batch completion: "
          f"priority / fcfs = {report['batch_done_priority_over_fcfs']:.2f}x")
    save_report(args.save_result, report)
    return report


def _warm_args(args: argparse.Namespace) -> argparse.Namespace:
    """One short batch and one interactive request: the kernels' first calls."""
    return argparse.Namespace(**{**vars(args), "batch_requests": 1, "interactive_requests": 1,
                                 "batch_output_len": 4, "interactive_output_len": 4,
                                 "delay_steps": 1})


if __name__ == "__main__":
    raise SystemExit(module_cli("python -m pagedserve.loadtest.priority_bench", __doc__, add_arguments,
                                main))
