"""Offline throughput benchmark: ``pagedserve bench throughput``.

Runs a seeded random workload through the engine, one ``LLMEngine.step()`` at a time,
and reports requests/s, generated tokens/s, peak KV cache waste and blocks, and the
workload's matrix-product floor: the time the model's linear layers alone take at the
token counts of the steps the engine ran. With float32 weights on the native CPU
kernels built at the CPU's best vector level, in one process (no tensor parallelism), it
also reports the arithmetic bound: the FLOPs of the matrix products the run computed at
this CPU's measured multiply-add peak, the least time any engine computing the same
products needs here (and, with ``--compare-hf``, HF static's time over it: the highest
ratio this host allows), and that bound plus the attention's reads of K/V at the host's
measured read bandwidth (each step's context read once). ``--compare-hf`` runs the same requests with
HF transformers (static batching and its own continuous batching) in the same process.

Also runnable as ``python -m pagedserve.loadtest.throughput``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

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
from pagedserve.loadtest.decode_bench import ReadBandwidth, kv_bytes_per_token
from pagedserve.loadtest.linear_floor import arithmetic_bound, linear_floor, step_breakdown
from pagedserve.loadtest.op_times import OpTimes, format_report
from pagedserve.loadtest.workloads import Workload, random_workload, shared_prefix_workload

logger = logging.getLogger("pagedserve.loadtest")


# -- flags ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench throughput``."""
    w = parser.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--input-len-min", type=int, default=32)
    w.add_argument("--input-len-max", type=int, default=256)
    w.add_argument("--output-len-min", type=int, default=64)
    w.add_argument("--output-len-max", type=int, default=128)
    w.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N-token document (a long shared "
                        "context); its own part is --input-len-min tokens and its output "
                        "--output-len-min")
    add_engine_args(parser)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True)
    r = parser.add_argument_group("run")
    r.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="a short untimed run before each timed one")
    r.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="time the matrix-product floor of the workload")
    r.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers (static and continuous batching)")
    r.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF static batch size (default: every request in one batch)")
    r.add_argument("--hf-static", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--hf-continuous", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--op-times", action="store_true",
                   help="time every layer op and attention call of the (first) engine run "
                        "and print where its steps' time went")
    r.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="with --compare-hf: N pagedserve / HF static pairs in all, run "
                        "alternately, and the median ratio (the host's speed drifts)")
    r.add_argument("--save-result", metavar="FILE.json", default=None)


# -- the run -------------------------------------------------------------------------------
def _workload(args: argparse.Namespace, token_ids: list[int]) -> Workload:
    if args.shared_prefix_len > 0:
        return shared_prefix_workload(token_ids, args.num_requests, args.shared_prefix_len,
                                      args.input_len_min, args.output_len_min, args.seed)
    return random_workload(
        token_ids, args.num_requests, (args.input_len_min, args.input_len_max),
        (args.output_len_min, args.output_len_max), args.seed)


def _fmt_rate(d: dict[str, Any]) -> str:
    return (f"{d['elapsed_s']:8.2f} s  {d['requests_per_s']:7.2f} req/s  "
            f"{d['output_tokens_per_s']:8.1f} out tok/s  {d['total_tokens_per_s']:8.1f} tok/s")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark, print its report, and return it (also saved with --save-result)."""
    import torch

    from pagedserve.engine.loop.llm import LLM
    from pagedserve.kernels.cpu import paths as cpu_paths

    apply_threads(args)
    env = environment_info()
    t_load = time.perf_counter()
    llm = LLM(model=args.model, **engine_kwargs(args))
    load_s = time.perf_counter() - t_load
    worker = llm.engine.worker
    dtype = str(worker.settings.dtype).removeprefix("torch.")
    token_ids = vocab_token_ids(llm)
    workload = _workload(args, token_ids)
    if worker.cpu_paths is not None:
        env["cpu_paths"] = worker.cpu_paths
    print_header("pagedserve bench throughput", env, {
        "model": f"{worker.settings.model_name} ({worker.settings.model_path})",
        "dtype": dtype + (f", weights {worker.quant_desc}" if worker.quant_desc else ""),
        "seed": args.seed,
        "engine": (f"max_num_seqs={llm.config.max_num_seqs} max_num_batched_tokens="
                   f"{llm.engine.scheduler.max_num_batched_tokens} block_size="
                   f"{llm.config.block_size} kv_blocks={llm.engine.kv.num_blocks} kv_cache="
                   f"{str(worker.kv_cache.dtype).removeprefix('torch.')} "
                   f"prefix_caching={'on' if llm.config.enable_prefix_caching else 'off'} "
                   f"attention={worker.attn.name}"),
        **({"cpu paths": cpu_paths.summary(worker.cpu_paths, dtype, worker.quant_desc)}
           if worker.cpu_paths is not None else {}),
        "workload": (f"{workload.num_requests} requests, "
                     + (f"a shared {args.shared_prefix_len}-token prefix + {args.input_len_min}"
                        f", output {args.output_len_min}" if args.shared_prefix_len > 0 else
                        f"input {args.input_len_min}-{args.input_len_max}, output "
                        f"{args.output_len_min}-{args.output_len_max}")
                     + " (ignore_eos, greedy): "
                     f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} "
                     "output tokens"),
    })
    if args.warmup:
        warm_up(llm, token_ids, args.seed)
    timers = OpTimes(llm.engine) if args.op_times else None
    tp = worker.tp
    comm0 = (tp.comm_s, tp.step_feed_s, tp.num_collectives) if tp is not None else None
    try:
        run = run_engine(llm, workload)
    finally:
        if timers is not None:
            timers.remove()
    if run.num_output_tokens != workload.num_output_tokens:
        logger.warning("generated %d tokens but the workload requested %d",
                       run.num_output_tokens, workload.num_output_tokens)
    floor = linear_floor(worker.model, run.steps,
                         worker.attn.ops.linear if worker.settings.quantization else None) \
        if args.floor else None  # fmt: skip
    ps = run.summary()
    ps["load_s"] = load_s
    breakdown = step_breakdown(run.steps, floor)
    if floor is not None:
        ps["floor"] = {k: v for k, v in floor.items() if not k.startswith("_")}
        ps["efficiency"] = floor["floor_s"] / run.elapsed_s
    ps["step_breakdown"] = breakdown
    if tp is not None:
        steps = max(1, len(run.steps))
        comm, feed = tp.comm_s - comm0[0], tp.step_feed_s - comm0[1]
        ps["tensor_parallel"] = {
            "size": tp.size, "collectives": tp.num_collectives - comm0[2],
            "collective_s": comm, "step_feed_s": feed,
            "collective_ms_per_step": comm / steps * 1e3,
            "step_feed_ms_per_step": feed / steps * 1e3,
            "fraction_of_run": (comm + feed) / run.elapsed_s}  # fmt: skip
    if timers is not None:
        ps["op_times"] = timers.report({"decode": breakdown["decode_time_s"],
                                        "prefill": breakdown["prefill_time_s"]})
    kv_size_gb = (llm.engine.kv.num_blocks * worker.block_bytes()) / 2**30
    max_tokens = llm.engine.scheduler.max_num_batched_tokens
    model_path = worker.settings.model_path
    quantization = worker.settings.quantization  # as served (a .gguf path's default too)
    pagedserve_ids = run.output_token_ids
    # One process's float32 products at the CPU's widest vectors: its threads' FMA peak
    # bounds them (tensor-parallel ranks run on other cores too; quantized or bfloat16
    # weights take other units; a library built at a narrower level than torch's BLAS
    # would measure a lower peak than torch reaches).
    bounded = (dtype == "float32" and not worker.settings.quantization and tp is None
               and worker.cpu_paths is not None
               and worker.cpu_paths["layer_ops"] == worker.cpu_paths["levels"][-1])
    peak_of = worker.attn.ops.fma_peak_gflops if bounded else None
    spec = worker.model.spec
    kv_token = kv_bytes_per_token(worker) if bounded else None
    llm.close()
    del llm, worker, tp
    gc.collect()
    threads = torch.get_num_threads()
    peak = peak_of(threads) if peak_of is not None else None
    del peak_of
    if peak is not None:
        read_gbs = ReadBandwidth()(repeats=5)
        ar = ps["arithmetic"] = arithmetic_bound(spec, run.steps, peak, kv_token, read_gbs)
        ar.update(threads=threads, fraction_of_peak=ar["bound_s"] / run.elapsed_s,
                  fraction_with_kv=ar["bound_with_kv_s"] / run.elapsed_s)

    _print_engine(run, ps, floor, breakdown)
    if timers is not None:
        print(format_report(ps["op_times"]))
    report: dict[str, Any] = {
        "benchmark": "throughput",
        "command": command_line(),
        "environment": env,
        "model": str(model_path),
        "dtype": dtype,
        "quantization": quantization,
        "seed": args.seed,
        "workload": workload.summary(),
        "pagedserve": ps,
    }
    if args.compare_hf:
        report.update(_compare_hf(args, workload, model_path, dtype, kv_size_gb, max_tokens,
                                  ps, pagedserve_ids))
        if args.repeat > 1 and args.hf_static:
            first = (ps["elapsed_s"], report["hf_static"]["elapsed_s"])
            bound = ps["arithmetic"]["bound_s"] if "arithmetic" in ps else None
            report["repeats"] = _repeat_pairs(args, workload, model_path, dtype, first, bound)
    if save_report(args.save_result, report):
        print(f"saved {args.save_result}")
    return report


def _print_engine(run: EngineRun, ps: dict[str, Any], floor: dict[str, Any] | None,
                  bd: dict[str, Any]) -> None:
    print("-- pagedserve --")
    print(f"pagedserve     {_fmt_rate(ps)}")
    print(f"generated:     {run.num_output_tokens} output tokens, {run.num_prompt_tokens} "
          f"prompt tokens, {run.num_requests} requests, {run.num_steps} steps, "
          f"{run.num_preemptions} preemptions")
    print(f"KV cache:      waste at peak usage {100 * run.kv_waste_at_peak_usage:.2f}%, "
          f"max over steps {100 * run.peak_kv_waste:.2f}% (mean {100 * run.mean_kv_waste:.2f}%), "
          f"peak blocks used {run.peak_blocks_used}/{run.num_blocks}, "
          f"prefix hit rate {100 * run.hit_rate:.1f}%")
    print(f"steps:         {bd['decode_steps']} decode-only steps {bd['decode_time_s']:.2f} s, "
          f"{bd['prefill_steps']} steps with prefill {bd['prefill_time_s']:.2f} s")
    tp = ps.get("tensor_parallel")
    if tp is not None:
        print(f"tensor par.:   {tp['size']} ranks; per step {tp['collective_ms_per_step']:.2f} ms "
              f"in collectives + {tp['step_feed_ms_per_step']:.2f} ms sending the step "
              f"({100 * tp['fraction_of_run']:.1f}% of the run)")
    if floor is not None:
        print(f"matmul floor:  {floor['floor_s']:.2f} s (layers {floor['layers_s']:.2f} s + "
              f"lm_head {floor['lm_head_s']:.2f} s); efficiency floor/elapsed = "
              f"{ps['efficiency']:.3f}")
        print(f"               decode steps: floor {bd['decode_floor_s']:.2f} s of "
              f"{bd['decode_time_s']:.2f} s; steps with prefill: floor "
              f"{bd['prefill_floor_s']:.2f} s of {bd['prefill_time_s']:.2f} s")
        if "decode_step_floor_s_at_max" in bd:
            print(f"               decode step at batch {bd['decode_batch_max']}: median "
                  f"{1e3 * bd['decode_step_median_s_at_max']:.1f} ms vs floor "
                  f"{1e3 * bd['decode_step_floor_s_at_max']:.1f} ms")
    ar = ps.get("arithmetic")
    if ar is not None:
        print(f"arithmetic:    {ar['matmul_flops'] / 1e12:.3f} TFLOP of matrix products "
              f"(layers {ar['layers_flops'] / 1e12:.3f} + lm_head "
              f"{ar['lm_head_flops'] / 1e12:.3f}); FMA peak {ar['fma_peak_gflops']:.1f} "
              f"GFLOP/s on {ar['threads']} threads: {ar['bound_s']:.2f} s at peak, the run "
              f"at {ar['fraction_of_peak']:.2f} of it")
        print(f"               with the attention's K/V reads: {ar['kv_read_bytes'] / 1e9:.1f} "
              f"GB at the measured {ar['read_gbs']:.1f} GB/s read ({ar['kv_read_s']:.2f} s): "
              f"{ar['bound_with_kv_s']:.2f} s, the run at {ar['fraction_with_kv']:.2f} of it")


def _repeat_pairs(args, workload: Workload, model_path, dtype: str,
                  first: tuple[float, float], bound_s: float | None) -> dict[str, Any]:
    """More pagedserve / HF static pairs after the first one (HF first in every other
    pair); the ratio of each pair and their median, and with the arithmetic bound
    ``bound_s`` the median of HF static's times over it. The engine's prefix cache is
    reset before every run."""
    from pagedserve.engine.loop.llm import LLM
    from pagedserve.loadtest import hf_baseline as hf

    llm = LLM(model=args.model, **engine_kwargs(args))
    model = hf.load_hf_model(model_path, dtype)
    bs = args.hf_batch_size or workload.num_requests
    if args.warmup:
        warm_up(llm, vocab_token_ids(llm), args.seed)
        hf.warm_up_static(model, workload)
    pairs = [first]
    for i in range(1, args.repeat):
        # Alternate the order inside a pair, so a host that speeds up or slows down over
        # the run does not favour one side.
        h = hf.run_static(model, workload, bs).elapsed_s if i % 2 else None
        llm.reset_prefix_cache()
        e = run_engine(llm, workload, sample_stats=False).elapsed_s
        if h is None:
            h = hf.run_static(model, workload, bs).elapsed_s
        pairs.append((e, h))
    del llm, model
    gc.collect()
    ratios = [h / e for e, h in pairs]  # same tokens, so the tok/s ratio is the time ratio
    print(f"-- {len(pairs)} pairs, HF first in the even ones (pagedserve s, HF static s, "
          "ratio) --")
    for i, ((e, h), r) in enumerate(zip(pairs, ratios, strict=True), start=1):
        print(f"pair {i}:        {e:7.2f} s   {h:7.2f} s   {r:.2f}x")
    med = statistics.median(ratios)
    print(f"median ratio output tok s vs hf static over {len(pairs)} pairs: {med:.2f}x "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")
    out = {"pairs": [{"pagedserve_s": e, "hf_static_s": h, "ratio": r}
                     for (e, h), r in zip(pairs, ratios, strict=True)],
           "median_ratio_vs_hf_static": med}
    if bound_s is not None:
        ceilings = [h / bound_s for _, h in pairs]
        for pair, c in zip(out["pairs"], ceilings, strict=True):
            pair["ceiling"] = c
        out["median_ceiling_vs_hf_static"] = statistics.median(ceilings)
        print(f"median ceiling vs hf static (HF static s / arithmetic bound "
              f"{bound_s:.2f} s): {out['median_ceiling_vs_hf_static']:.2f}x "
              f"(pairs: {', '.join(f'{c:.2f}x' for c in ceilings)})")
    return out


def _compare_hf(args, workload: Workload, model_path, dtype: str, kv_gb: float,
                max_tokens: int, ps: dict[str, Any], ps_ids: list[list[int]]) -> dict[str, Any]:
    from pagedserve.loadtest import hf_baseline as hf

    model = hf.load_hf_model(model_path, dtype)
    out: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    agreement: dict[str, Any] = {}
    print("-- HF transformers, same workload --")
    if args.hf_static:
        bs = args.hf_batch_size or workload.num_requests
        if args.warmup:
            hf.warm_up_static(model, workload)
        st = hf.run_static(model, workload, bs)
        out["hf_static"] = st.summary()
        ratios["output_tok_s_vs_hf_static"] = ps["output_tokens_per_s"] / \
            out["hf_static"]["output_tokens_per_s"]
        agreement["hf_static"] = hf.greedy_agreement(ps_ids, st.output_token_ids)
        print(f"hf static      {_fmt_rate(out['hf_static'])}  (batch {bs}, left padding, "
              f"{st.num_generated_tokens} tokens generated for {st.num_output_tokens} useful)")
        if "arithmetic" in ps:  # the most any engine's ratio can be on this host
            out["ceiling_vs_hf_static"] = st.elapsed_s / ps["arithmetic"]["bound_s"]
    if args.hf_continuous:
        cb = hf.run_continuous(model, workload, kv_gb, max_tokens, args.max_num_seqs)
        out["hf_continuous"] = cb.summary()
        ratios["output_tok_s_vs_hf_continuous"] = ps["output_tokens_per_s"] / \
            out["hf_continuous"]["output_tokens_per_s"]
        agreement["hf_continuous"] = hf.greedy_agreement(ps_ids, cb.output_token_ids)
        print(f"hf continuous  {_fmt_rate(out['hf_continuous'])}  "
              f"(generate_batch manager, attn {cb.settings['attn_implementation']}, "
              f"max_batch_tokens {max_tokens})")
    del model
    gc.collect()
    for k, v in ratios.items():
        print(f"ratio {k.replace('_', ' ')}: {v:.2f}x")
    if "ceiling_vs_hf_static" in out:
        print(f"ceiling vs hf static: {out['ceiling_vs_hf_static']:.2f}x (HF static's time over "
              "the arithmetic bound: no engine computing the same products exceeds it here)")
    for k, v in agreement.items():
        print(f"greedy agreement with {k}: {100 * v['identical']:.0f}% identical outputs, "
              f"{100 * v['common_prefix']:.1f}% mean common prefix")
    out["ratios"] = ratios
    out["greedy_agreement"] = agreement
    return out


def cli(argv: Sequence[str] | None = None) -> int:
    return module_cli("python -m pagedserve.loadtest.throughput", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
