"""Decode latency: ``pagedserve bench decode``.

For each batch size, that many greedy requests of ``--prompt-len`` random tokens are
prefilled, then ``--steps`` decode steps are timed one by one (``LLMEngine.step()``):
the median and p90 step, tokens per second, and the bytes of weights one step reads
(every linear and the logits) and of the KV cache it attends to (each request's context
in every layer) against this machine's read bandwidth (a torch ``sum`` over a buffer
larger than the caches, on all threads): the floor a step cannot beat and the share of
it the engine reaches. With a long ``--prompt-len`` this is the long-context decode:
``read x`` is the step over the time to read its weights and KV cache. A shared host's
bandwidth swings from minute to minute, so the same ``sum`` is also read after every
timed step (untimed, the better of two): each step is held against the bandwidth read
beside it (``GB/s``, the median of those readings; ``read x``, the median of the steps'
ratios, and its p90). ``--op-times`` adds where one step's time goes (every layer op
and attention call, timed through ``ModelRunner.instrument``).
``--agreement N`` compares the greedy outputs (N tokens each, a fixed set of prompts)
with those of the same model in float32 (float32 KV cache too): identical outputs, mean
common prefix, and the largest difference of the chosen token's logprob along the common
prefixes. A GPTQ or AWQ checkpoint has no float32 form of its own: name the float
checkpoint it was made from with ``--agreement-model``.

The latency a single chat user sees is the batch-1 step; compare weight formats with
``--quantization`` and ``--dtype``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.loadtest.bench_common import (
    add_engine_args,
    apply_threads,
    engine_kwargs,
    environment_info,
    module_cli,
    print_header,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench decode``."""
    w = parser.add_argument_group("workload")
    w.add_argument("--batch-sizes", default="1,8", help="comma-separated request counts")
    w.add_argument("--prompt-len", type=int, default=64)
    w.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    add_engine_args(parser)
    r = parser.add_argument_group("run")
    r.add_argument("--op-times", action="store_true",
                   help="also time every layer op and attention call of the batch-1 steps")
    r.add_argument("--agreement", type=int, default=0, metavar="N",
                   help="compare N greedy tokens per prompt with the float32 model")
    r.add_argument("--agreement-model", default=None, metavar="PATH",
                   help="the float32 model --agreement compares with (default: --model; "
                        "required for a GPTQ/AWQ checkpoint)")
    r.add_argument("--save-result", default=None, help="write the report as JSON")


class ReadBandwidth:
    """GB/s of a torch ``sum`` over a buffer of ``mib`` MiB, larger than the caches."""

    def __init__(self, mib: int = 512) -> None:
        import torch

        self._x = torch.ones(mib * 1024 * 1024 // 4)
        self._x.sum()

    def __call__(self, repeats: int = 1) -> float:
        """One reading: the best of ``repeats`` sums."""
        best = min(_timed(self._x.sum) for _ in range(repeats))
        return self._x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(model: Any, batch: int | None = None) -> int:
    """Bytes of the weights a decode step of ``batch`` requests reads: every linear and
    the logits'; of a layer's experts, the share that ``batch`` tokens are expected to
    route to when the routing is uniform (each expert is missed by a token with
    probability ``1 - top_k / num_experts``). ``None``: every expert."""
    total = sum(w.nbytes for w in model.linear_weights())  # tensors and QuantizedWeight
    if batch is None:
        return total
    for layer in model.layers:
        if layer.moe is not None:
            spec = layer.moe.spec
            used = 1 - (1 - spec.top_k / spec.num_experts) ** batch
            experts = sum(p.weight.nbytes for e in layer.moe.experts
                          for p in (e.gate_up_proj, e.down_proj))  # fmt: skip
            total -= round(experts * (1 - used))
    return total


def kv_bytes_per_token(worker: Any) -> int:
    """Bytes of one token's K and V over every layer of the worker's KV cache (each
    layer's own view: with KV groups, layers of different groups share a tensor)."""
    return sum((k[0, 0].numel() + v[0, 0].numel()) * k.element_size()
               for k, v in worker.runner.kv_caches)  # [blocks, block_size, kv heads, dim]


def time_decode(llm: Any, batch: int, prompt_len: int, steps: int, seed: int,
                contexts: list[int] | None = None,
                after_step: Callable[[], None] | None = None) -> tuple[list[float], float]:
    """Seconds of each of ``steps`` decode steps of ``batch`` greedy requests, and the
    seconds of the other steps (prefill); ``contexts`` (if given) gets each timed step's
    total context, the KV rows its attention reads, and ``after_step`` (if given) runs,
    untimed, after each timed step."""
    import random

    from pagedserve import SamplingParams

    eng = llm.engine
    rng = random.Random(seed + batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(None, [rng.randrange(100, 10000) for _ in range(prompt_len)], params)
    times: list[float] = []
    other = 0.0
    while eng.has_unfinished_requests():
        context = sum(r.num_computed_tokens + 1 for r in eng.scheduler.running)
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        st = eng.last_step
        if st is not None and st.num_decodes == st.num_requests == batch:
            times.append(dt)
            if contexts is not None:
                contexts.append(context)
            if after_step is not None:
                after_step()
        else:
            other += dt
    return times, other


AGREEMENT_PROMPTS = (
    "Explain the architectural differences between microservices and monoliths.",
    "Write a Python script to implement a lock-free ring buffer.",
    "The capital of France is",
    "def fibonacci(n):",
    "Translate to French: The weather is nice today.",
    "Q: What is 12 times 7?\nA:",
    "Give me three tips for writing readable Python code.",
    "Once upon a time, in a small village by the sea,",
)


def check_agreement_model(args: argparse.Namespace) -> None:
    """Before any run: the model ``--agreement`` compares with (``--agreement-model``,
    else ``--model``) must be a float one; a GPTQ or AWQ checkpoint has no float32 form."""
    from pagedserve.engine.loader import load_config, resolve_model_path
    from pagedserve.engine.loader.checkpoint_quant import read_quantization_config

    if not args.agreement:
        return
    ref = args.agreement_model or args.model
    path = resolve_model_path(ref)
    qc = read_quantization_config(load_config(path), path)
    if qc is not None:
        raise SystemExit(
            f"--agreement: {ref} is a {qc.get('quant_method')} checkpoint, not a float32 model"
            + ("" if args.agreement_model else
               ": pass --agreement-model with the float checkpoint"))  # fmt: skip


def agreement(args: argparse.Namespace, num_tokens: int) -> dict[str, Any]:
    """Greedy outputs of the configured engine against the float32 model's."""
    import gc

    from pagedserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens,
                            logprobs=0)
    runs = []
    reference = dict(model=args.agreement_model or args.model, **engine_kwargs(
        args, quantization=None, dtype="float32", kv_cache_dtype="auto"))  # fmt: skip
    for kwargs in (dict(model=args.model, **engine_kwargs(args)), reference):
        llm = LLM(**kwargs)
        runs.append([o.outputs[0] for o in llm.generate(list(AGREEMENT_PROMPTS), params,
                                                         use_tqdm=False)])
        del llm
        gc.collect()
    identical, prefix, max_diff = 0, 0.0, 0.0
    for got, ref in zip(*runs, strict=True):
        n = 0
        while n < min(len(got.token_ids), len(ref.token_ids)) and \
                got.token_ids[n] == ref.token_ids[n]:
            n += 1
        identical += got.token_ids == ref.token_ids
        prefix += n / max(1, len(ref.token_ids))
        for a, b in zip(got.logprobs[:n], ref.logprobs[:n], strict=True):
            max_diff = max(max_diff, abs(a.logprob - b.logprob))
    count = len(AGREEMENT_PROMPTS)
    return {"prompts": count, "tokens": num_tokens, "identical": identical / count,
            "mean_common_prefix": prefix / count, "max_logprob_diff": max_diff}


def main(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import LLM
    from pagedserve.kernels.cpu import paths as cpu_paths
    from pagedserve.loadtest.op_times import OpTimes, format_report

    apply_threads(args)
    check_agreement_model(args)
    env = environment_info()
    llm = LLM(model=args.model, **engine_kwargs(args, enable_prefix_caching=False))
    worker = llm.engine.worker
    nbytes = weight_bytes(worker.model)
    kv_token = kv_bytes_per_token(worker)
    read_gbs = ReadBandwidth()
    bandwidth = read_gbs(repeats=5)
    batch1 = weight_bytes(worker.model, 1)  # the experts one token reads
    floor_ms = batch1 / (bandwidth * 1e9) * 1e3
    print_header("pagedserve bench decode", env, {
        "model": f"{worker.settings.model_name} ({worker.settings.model_path})",
        "weights": f"{str(worker.settings.dtype).removeprefix('torch.')}"
                   + (f", {worker.quant_desc}" if worker.quant_desc else "")
                   + f": {nbytes / 1e6:.1f} MB read per step"
                   + ("" if nbytes == batch1 else
                      f" with every expert ({batch1 / 1e6:.1f} MB at "
                      "batch 1; 'read ms' counts the experts a batch uses when routed "
                      "evenly)"),
        "memory": f"read bandwidth {bandwidth:.1f} GB/s: {floor_ms:.2f} ms a step at least "
                  f"(weights at batch 1), KV cache {kv_token / 1e3:.1f} kB a token of context "
                  f"({str(worker.kv_cache.dtype).removeprefix('torch.')})",
        **({"cpu paths": cpu_paths.summary(worker.cpu_paths,
                                           str(worker.settings.dtype).removeprefix("torch."),
                                           worker.quant_desc)}
           if worker.cpu_paths is not None else {}),
    })
    time_decode(llm, 1, args.prompt_len, 8, args.seed)  # warm-up
    report: dict[str, Any] = {"env": env, "weight_bytes": nbytes, "read_gbs": bandwidth,
                              "floor_ms": floor_ms, "kv_bytes_per_token": kv_token,
                              "batches": []}
    print(f"{'batch':>5} {'median ms':>10} {'p90 ms':>8} {'tok/s':>8} {'floor/step':>10} "
          f"{'KV MB':>8} {'GB/s':>6} {'read ms':>8} {'read x':>7} {'p90 x':>6}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        contexts: list[int] = []
        readings: list[float] = []
        steps = time_decode(llm, batch, args.prompt_len, args.steps, args.seed, contexts,
                            lambda readings=readings: readings.append(read_gbs(repeats=2)))[0]
        times = sorted(steps)
        med, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
        kv = statistics.mean(contexts) * kv_token
        gbs = statistics.median(readings)
        step_bytes = weight_bytes(worker.model, batch)
        read_ms = (step_bytes + kv) / (gbs * 1e9) * 1e3
        # Each step against the time to read its own bytes at the bandwidth read beside it.
        ratios = sorted(dt * gb * 1e9 / (step_bytes + ctx * kv_token)
                        for dt, ctx, gb in zip(steps, contexts, readings, strict=True))
        floor_b = step_bytes / (bandwidth * 1e9) * 1e3
        row = {"batch": batch, "median_ms": med * 1e3, "p90_ms": p90 * 1e3,
               "tokens_per_s": batch / med, "floor_ratio": floor_b / (med * 1e3),
               "kv_bytes": kv, "weight_bytes": step_bytes, "read_gbs": gbs, "read_ms": read_ms,
               "read_ratio": statistics.median(ratios),
               "read_ratio_p90": ratios[int(0.9 * (len(ratios) - 1))],
               "step_ms": [dt * 1e3 for dt in steps], "step_read_gbs": readings,
               "step_contexts": contexts}
        report["batches"].append(row)
        print(f"{batch:>5} {row['median_ms']:>10.2f} {row['p90_ms']:>8.2f} "
              f"{row['tokens_per_s']:>8.1f} {row['floor_ratio']:>10.2f} {kv / 1e6:>8.1f} "
              f"{gbs:>6.1f} {read_ms:>8.2f} {row['read_ratio']:>7.2f} "
              f"{row['read_ratio_p90']:>6.2f}")
    if args.op_times:
        timers = OpTimes(llm.engine)
        try:
            times, other = time_decode(llm, 1, args.prompt_len, args.steps, args.seed)
        finally:
            timers.remove()
        report["op_times"] = timers.report({"decode": sum(times), "prefill": other})
        print(format_report(report["op_times"]))
    if args.agreement:
        del llm
        report["agreement"] = agreement(args, args.agreement)
        a = report["agreement"]
        against = f" {args.agreement_model}" if args.agreement_model else ""
        print(f"greedy agreement with float32{against}: {a['identical']:.0%} identical outputs, "
              f"{a['mean_common_prefix']:.1%} mean common prefix, max |logprob difference| "
              f"of the chosen token {a['max_logprob_diff']:.4f}")
    if args.save_result:
        import json

        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def cli(argv: Sequence[str] | None = None) -> int:
    return module_cli("python -m pagedserve.loadtest.decode_bench", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
