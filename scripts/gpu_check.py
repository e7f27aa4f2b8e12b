"""The Python parts of ``scripts/gpu_check.sh``: checks of the CUDA path on a GPU machine.

Subcommands (each appends one-line results to ``--summary FILE`` when given):

* ``make-model``: a random-weight model folder with a synthetic word-level tokenizer
  (no downloads): the HF-equivalence archs or a Llama-3.2-1B-shaped model for the bench.
* ``hf-equivalence``: greedy tokens of the engine (decode CUDA graphs on, and eager)
  against HF transformers ``generate`` on tiny random Llama / Qwen2 / Qwen3 models;
  float32 must match exactly, bfloat16 reports agreement.
* ``bench``: ``pagedserve bench throughput`` (``pagedserve.loadtest.throughput``) with CUDA graphs
  on or off (``--enforce-eager``), plus the engine's KV-budget and capture log lines.
* ``gate``: the bfloat16 gate (:mod:`gpu_gate`): engines, kernels, compiles after
  warm-up and the step-time split.
* ``bandwidth``: the Triton paged decode-attention kernel's K/V read bandwidth against
  the H200's 4.8 TB/s and a measured device copy. ``--device cpu`` runs a tiny case in
  the Triton interpreter (a check of the script, not a measurement).

``--dry-run`` (or ``GPU_CHECK_DRY_RUN=1``) parses every argument and does each
subcommand's set-up (configs, workloads, the bench's own argument parsing and engine
arguments), then stops before its first CUDA call and says so: a CPU-only machine can
check that nothing in the script has rotted.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The sibling scripts first; the checkout (for ``tests.helpers``) after site-packages, where
# its folders' bare names (``kernels``) cannot shadow installed distributions.
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import gpu_bandwidth  # noqa: E402  (scripts/gpu_bandwidth.py: the decode-attention part)
import gpu_gate  # noqa: E402  (scripts/gpu_gate.py: the bf16 gate part)
from random_models import model_config, write_random_model  # noqa: E402

logger = logging.getLogger("gpu_check")


class DryRunStop(Exception):
    """Raised by :func:`before_cuda` in a dry run: the set-up is done."""


def before_cuda(args: argparse.Namespace, what: str) -> None:
    """The subcommand's next call touches CUDA (``what``): stop here in a dry run."""
    if getattr(args, "dry_run", False):
        raise DryRunStop(what)


def emit(summary: str | None, line: str) -> None:
    """Log ``line`` and append it to the summary file."""
    logger.info("%s", line)
    if summary:
        with open(summary, "a") as f:
            f.write(line + "\n")


# -- random models (scripts/random_models.py) ----------------------------------------------
def cmd_make_model(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cfg = model_config(args.preset)
    before_cuda(args, f"drawing the {cfg.model_type} weights on {args.device}")
    out = write_random_model(Path(args.out), args.preset, args.std, args.seed, args.device,
                             args.save_dtype)  # fmt: skip
    size = sum(f.stat().st_size for f in out.iterdir())
    emit(args.summary, f"model {args.preset}: {size / 2**30:.2f} GiB written in "
                       f"{time.perf_counter() - t0:.1f}s to {out}")  # fmt: skip
    return 0


# -- HF equivalence ------------------------------------------------------------------------
def _prompts(n: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lens = [5, 17, 30, 45, 63, 90][:n]  # none a multiple of the block size
    return [torch.randint(100, 40000, (k,), generator=gen).tolist() for k in lens]


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int, dtype: str,
              device: str) -> list[list[int]]:  # fmt: skip
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype)).to(device).eval()  # fmt: skip
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
            outs.append(y[0, len(ids) :].tolist())
    del model
    return outs


def engine_greedy(path: Path, prompts: list[list[int]], new_tokens: int,
                  **kwargs: Any) -> tuple[list[list[int]], dict[str, Any]]:  # fmt: skip
    """Greedy tokens of the engine and a few facts about the run."""
    import torch

    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(path), **kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    runner = llm.engine.worker.runner.decode_graphs
    info = {"graph_replays": runner.num_replays if runner is not None else 0,
            "backend": llm.engine.worker.attn.name}  # fmt: skip
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, runner, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, info


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[int, float]:
    """(identical outputs, mean common-prefix fraction)."""
    same = sum(list(x) == list(y) for x, y in zip(a, b, strict=True))
    frac = []
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        frac.append(k / max(len(x), 1))
    return same, sum(frac) / max(len(frac), 1)


def cmd_hf_equivalence(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    failed = 0
    prompts = _prompts(args.num_prompts, 0)
    configs = [model_config(arch) for arch in args.archs]
    before_cuda(args, f"random {'/'.join(c.model_type for c in configs)} models on the GPU")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            path = write_random_model(Path(tmp) / arch, arch, std=0.15, device=device)
            for dtype in args.dtypes:
                t0 = time.perf_counter()
                ref = hf_greedy(path, prompts, args.new_tokens, dtype, device)
                common = dict(dtype=dtype, device=device, kv_cache_memory_gb=1.0,
                              enable_prefix_caching=False, max_num_seqs=8,
                              max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
                variants = {"graphs": {}, "eager": {"enforce_eager": True}}
                for name, extra in variants.items():
                    got, info = engine_greedy(path, prompts, args.new_tokens, **common, **extra)
                    same, prefix = agreement(got, ref)
                    exact = same == len(ref)
                    if dtype == "float32":
                        status = "PASS" if exact else "FAIL"
                        failed += not exact
                    else:
                        status = "INFO"
                    emit(args.summary,
                         f"hf-eq {arch:5s} {dtype:8s} {name:6s} {status}: {same}/{len(ref)} "
                         f"identical, common prefix {100 * prefix:5.1f}% "
                         f"({info['backend']}, {info['graph_replays']} graph replays, "
                         f"{time.perf_counter() - t0:.1f}s)")  # fmt: skip
                    moe = arch.endswith("_moe")  # experts: decode runs eagerly on CUDA
                    if name == "graphs" and device == "cuda" and not moe \
                            and info["graph_replays"] == 0:  # fmt: skip
                        emit(args.summary, f"hf-eq {arch} {dtype}: FAIL no CUDA graph replay")
                        failed += 1
    return 1 if failed else 0


# -- throughput bench ------------------------------------------------------------------------
class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def bench_parser() -> argparse.ArgumentParser:
    """The parser of ``pagedserve bench throughput`` (``pagedserve.loadtest.throughput``'s flags)."""
    from pagedserve.loadtest import throughput

    parser = argparse.ArgumentParser(prog="gpu_check.py bench", add_help=False)
    throughput.add_arguments(parser)
    return parser


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from pagedserve.loadtest import throughput

    bargs = bench_parser().parse_args(rest)
    if "enforce_eager" in vars(bargs):
        bargs.enforce_eager = args.enforce_eager
    else:  # the bench has no flag for it: add the engine argument to its LLM(...) call
        base = throughput.engine_kwargs

        def with_eager(a: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
            return {**base(a, **overrides), "enforce_eager": args.enforce_eager}

        throughput.engine_kwargs = with_eager
    kwargs = throughput.engine_kwargs(bargs)
    if bargs.model is None or not args.dry_run and not Path(bargs.model).is_dir():
        raise SystemExit(f"bench: --model must name a model folder, got {bargs.model!r}")
    before_cuda(args, f"LLM(model={Path(bargs.model).name!r}, dtype={kwargs['dtype']!r}, "
                      f"max_num_seqs={kwargs['max_num_seqs']}, "
                      f"enforce_eager={kwargs.get('enforce_eager', False)})")  # fmt: skip
    collect = _Collect()
    for name in ("pagedserve.engine.worker.gpu_memory", "pagedserve.engine.worker.cuda_graphs", "pagedserve.engine"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.addHandler(collect)
    t0 = time.perf_counter()
    report = throughput.main(bargs)
    ps = report["pagedserve"]
    bd = ps["step_breakdown"]
    mode = "eager " if args.enforce_eager else "graphs"
    dec_ms = 1e3 * bd["decode_time_s"] / max(bd["decode_steps"], 1)
    line = (f"bench {mode}: {ps['output_tokens_per_s']:9.1f} out tok/s "
            f"{ps['requests_per_s']:7.2f} req/s; decode-only steps {bd['decode_steps']} "
            f"({dec_ms:.2f} ms/step")  # fmt: skip
    if "decode_step_median_s_at_max" in bd:
        line += (f", median {1e3 * bd['decode_step_median_s_at_max']:.2f} ms at batch "
                 f"{bd['decode_batch_max']}")  # fmt: skip
    line += (f"), prefill steps {bd['prefill_steps']} ({bd['prefill_time_s']:.2f}s); "
             f"{ps['num_blocks']} KV blocks; {time.perf_counter() - t0:.0f}s total")  # fmt: skip
    if "efficiency" in ps:
        line += f"; matmul-floor efficiency {ps['efficiency']:.3f}"
    emit(args.summary, line)
    keep = [m for m in collect.lines
            if m.startswith(("GPU memory", "KV cache budget", "captured", "CUDA graphs"))]  # fmt: skip
    for m in keep:
        emit(args.summary, f"  {mode}: {m}")
    if args.save_json:
        Path(args.save_json).write_text(json.dumps(report, indent=2, default=str))
    return 0


# -- CLI -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summary", default=os.environ.get("GPU_CHECK_SUMMARY"),
                   help="append result lines to this file")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   default=os.environ.get("GPU_CHECK_DRY_RUN", "") == "1",
                   help="set up, then stop before the first CUDA call")  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model", help="write a random-weight model folder")
    m.add_argument("--preset", default="llama-1b",
                   choices=["llama", "qwen2", "qwen3", "qwen3_moe", "llama-1b"])  # fmt: skip
    m.add_argument("--out", required=True)
    m.add_argument("--std", type=float, default=0.02)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default="cuda")
    m.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    h = sub.add_parser("hf-equivalence", help="engine vs HF greedy tokens on tiny models")
    h.add_argument("--archs", nargs="+", default=["llama", "qwen2", "qwen3", "qwen3_moe"])
    h.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    h.add_argument("--num-prompts", type=int, default=6)
    h.add_argument("--new-tokens", type=int, default=32)
    h.add_argument("--max-num-batched-tokens", type=int, default=16)
    b = sub.add_parser("bench", help="the throughput bench; other flags go to it",
                       description="Flags not listed here go to pagedserve.loadtest.throughput.")  # fmt: skip
    b.add_argument("--enforce-eager", action="store_true")
    b.add_argument("--save-json", default=None)
    gpu_gate.add_parser(sub)
    w = sub.add_parser("bandwidth", help="decode attention K/V read bandwidth")
    w.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    w.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args, rest = build_parser().parse_known_args(argv)
    if args.cmd != "bench" and rest:
        raise SystemExit(f"unknown arguments: {rest}")
    try:
        if args.cmd == "bench":
            return cmd_bench(args, rest)
        if args.cmd == "gate":
            return gpu_gate.cmd_gate(args, before_cuda, emit, lambda out, cfg: write_random_model(
                out, "llama", 0.15, save_dtype="bfloat16", cfg=cfg))  # fmt: skip
        if args.cmd == "bandwidth":
            return gpu_bandwidth.cmd_bandwidth(args, before_cuda, emit)
        return {"make-model": cmd_make_model,
                "hf-equivalence": cmd_hf_equivalence}[args.cmd](args)  # fmt: skip
    except DryRunStop as stop:
        emit(args.summary, f"dry run: {args.cmd} set up; stopped before the first CUDA "
                           f"call ({stop})")  # fmt: skip
        return 0


if __name__ == "__main__":
    sys.exit(main())
