"""Shared pieces of the offline benchmarks: engine flags, the environment header, and an
engine run driven step by step so that KV cache statistics are sampled after each step.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedserve.engine import envs
from pagedserve.engine.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    QUANTIZED_ACTIVATIONS,
)
from pagedserve.loadtest.workloads import Workload, allowed_token_ids

logger = logging.getLogger("pagedserve.loadtest")



# -- flags -------------------------------------------------------------------------------

class _NegatableFlag(argparse.Action):
    """A switch whose ``--no-...`` spellings turn it off and whose others turn it on."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model and engine flags shared by the offline benchmarks."""
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="local HF folder or hub id (default: the embedded default model)")
    g.add_argument("--dtype", default="float32", choices=DTYPES)
    g.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="weight-only quantized linears (default: none)")
    g.add_argument("--quantized-activations", default="auto", choices=QUANTIZED_ACTIVATIONS,
                   help="the quantized linears' activations on the CPU: int8, float, or auto "
                        "(int8 on the AVX2 and AVX-512 builds; default)")
    g.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per engine step (default: the engine's)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV cache size (default: the engine's, 1 GiB on the CPU)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache element type (default: the model's dtype)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    # Spelled as `pagedserve serve` spells it, and the short form.
    g.add_argument("--enable-chunked-prefill", "--no-enable-chunked-prefill",
                   "--no-chunked-prefill", dest="enable_chunked_prefill",
                   action=_NegatableFlag, default=True, help="(default: on)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    g.add_argument("--device", default="auto", choices=DEVICES)
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (default: 1)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """``LLM(**kwargs)`` from the shared flags."""
    kw: dict[str, Any] = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "quantized_activations": getattr(args, "quantized_activations", "auto"),
        "seed": args.seed,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "attention_backend": args.attention_backend,
        "device": args.device,
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
        "enable_prefix_caching": getattr(args, "enable_prefix_caching", True),
    }
    kw.update(overrides)
    return kw


def apply_threads(args: argparse.Namespace) -> None:
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


# -- environment -------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _pagedserve_version() -> str:
    """The installed distribution's version, else the source tree's, with its git commit."""
    import subprocess
    from pathlib import Path

    from pagedserve import __version__ as version

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version} (git {commit})" if commit else version


def environment_info() -> dict[str, Any]:
    """Hardware, thread settings and library versions."""
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_cores": cores,
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg")
        else None,
        "omp_wait_policy": envs.omp_wait_policy() or "(unset)",
        "gomp_spincount": envs.gomp_spincount() or "(unset)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "pagedserve": _pagedserve_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def command_line() -> str:
    """The command as typed, re-quoted."""
    argv = list(sys.argv)
    if argv:
        exe = os.path.basename(argv[0])
        if exe.endswith(".py") and os.path.basename(os.path.dirname(argv[0])) == "loadtest":
            argv[:1] = ["python", "-m", f"pagedserve.loadtest.{exe[:-3]}"]
        elif exe.endswith(".py"):
            argv[:1] = ["python", os.path.relpath(argv[0])]
        else:
            argv[0] = exe
    return " ".join(shlex.quote(a) for a in argv)


def print_header(title: str, env: dict[str, Any], extra: dict[str, Any]) -> None:
    print(f"== {title} ==")
    print(f"command:   {command_line()}")
    print(f"hardware:  {env['cpu']}, {env['cpu_cores']} cores, torch threads "
          f"{env['torch_threads']}, load average {env['load_average']}, "
          f"OMP_WAIT_POLICY={env['omp_wait_policy']} GOMP_SPINCOUNT={env['gomp_spincount']}"
          + (f", GPU {env['gpu']}" if "gpu" in env else ""))
    print(f"versions:  python {env['python']}, torch {env['torch']}, transformers "
          f"{env['transformers']}, pagedserve {env['pagedserve']}")
    for k, v in extra.items():
        print(f"{k + ':':<10} {v}")


# -- the engine run ----------------------------------------------------------------------
@dataclass(slots=True)
class StepRecord:
    """One engine step: tokens computed, rows sampled, decodes, and its wall time."""

    num_tokens: int
    num_sampled: int
    num_decodes: int
    seconds: float
    context_tokens: int = 0
    """Tokens of context the step's attention read (every request's, computed ones
    included)."""


@dataclass
class EngineRun:
    """What one workload run on the engine measured."""

    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    """Tokens actually generated (summed over the finished outputs)."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache (``RequestOutput.num_cached_tokens``)."""
    num_computed_tokens: int
    """Tokens the model ran on, over all steps (prefill + decode, recomputation included)."""
    num_steps: int
    num_preemptions: int
    peak_kv_waste: float
    """The largest waste over all steps (early steps, with short sequences, dominate)."""
    mean_kv_waste: float
    peak_blocks_used: int
    kv_waste_at_peak_usage: float
    """Waste at the step with the most blocks in use: what memory pressure sees."""
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    stats_overhead_s: float
    steps: list[StepRecord] = field(default_factory=list, repr=False)
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def num_prefill_computed(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("steps", "output_token_ids")}
        d["num_prefill_computed"] = self.num_prefill_computed
        d["prefix_cache_hit_rate"] = self.hit_rate
        d["requests_per_s"] = self.num_requests / self.elapsed_s
        d["output_tokens_per_s"] = self.num_output_tokens / self.elapsed_s
        d["total_tokens_per_s"] = (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s
        return d


def vocab_token_ids(llm) -> list[int]:
    """Non-special token ids of the engine's model vocabulary."""
    tok = llm.get_tokenizer()
    return allowed_token_ids(llm.engine.settings.vocab_size, tok.all_special_ids)


def run_engine(llm, workload: Workload, sample_stats: bool = True) -> EngineRun:
    """Run ``workload`` on ``llm.engine`` to completion, one ``step()`` at a time.

    Greedy sampling with ``ignore_eos``: each request generates exactly its
    ``output_len`` tokens. After every step the KV cache statistics are sampled; the
    time spent sampling them is measured and left out of ``elapsed_s``.
    """
    from pagedserve.engine.core.sampling_params import SamplingParams

    eng = llm.engine
    kv = eng.kv
    sched = eng.scheduler
    base = kv.stats()
    base_preempt = sched.num_preemptions
    steps: list[StepRecord] = []
    peak_waste = 0.0
    waste_sum = 0.0
    peak_blocks = 0
    waste_at_peak = 0.0
    stats_time = 0.0
    results = {}
    t0 = time.perf_counter()
    ids = []
    for r in workload.requests:
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
        ids.append(eng.add_request(None, r.prompt_token_ids, sp).request_id)
    while eng.has_unfinished_requests():
        ts = time.perf_counter()
        eng.last_step = None
        outs = eng.step()
        te = time.perf_counter()
        for out in outs:
            if out.finished:
                results[out.request_id] = out
        if (ran := eng.last_step) is not None:
            steps.append(StepRecord(ran.num_tokens, ran.num_sampled, ran.num_decodes, te - ts,
                                    ran.num_context_tokens))
        if sample_stats:
            st = kv.stats()
            peak_waste = max(peak_waste, st.waste)
            waste_sum += st.waste
            if st.num_used_blocks >= peak_blocks:
                peak_blocks, waste_at_peak = st.num_used_blocks, st.waste
            stats_time += time.perf_counter() - te
    elapsed = time.perf_counter() - t0 - stats_time
    end = kv.stats()
    outs = [results[rid] for rid in ids]
    out_ids = [list(o.outputs[0].token_ids) for o in outs]
    return EngineRun(
        elapsed_s=elapsed,
        num_requests=len(outs),
        num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        num_output_tokens=sum(len(t) for t in out_ids),
        num_cached_tokens=sum(o.num_cached_tokens for o in outs),
        num_computed_tokens=sum(s.num_tokens for s in steps),
        num_steps=len(steps),
        num_preemptions=sched.num_preemptions - base_preempt,
        peak_kv_waste=peak_waste,
        mean_kv_waste=waste_sum / len(steps) if steps else 0.0,
        peak_blocks_used=peak_blocks,
        kv_waste_at_peak_usage=waste_at_peak,
        num_blocks=kv.num_blocks,
        prefix_cache_queries=end.prefix_cache_queries - base.prefix_cache_queries,
        prefix_cache_hits=end.prefix_cache_hits - base.prefix_cache_hits,
        stats_overhead_s=stats_time,
        steps=steps,
        output_token_ids=out_ids,
    )


def warm_up(llm, token_ids: list[int], seed: int) -> None:
    """A short run so that one-time kernel and allocator setup stays out of the timing."""
    from pagedserve.loadtest.workloads import random_workload

    run_engine(llm, random_workload(token_ids, 4, (48, 96), (4, 8), seed + 7919),
               sample_stats=False)
    llm.reset_prefix_cache()


def save_report(path: str | None, report: Any) -> bool:
    """Write ``report`` as JSON to ``path`` (``--save-result``) when one is given."""
    if not path:
        return False
    import json

    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    return True


def module_cli(prog: str, doc: str, add_arguments, main, argv=None) -> int:
    """``python -m loadtest.X``: parse ``argv`` with the module's arguments and run it."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    main(parser.parse_args(argv))
    return 0
