"""The host's share of an engine step: a model whose arithmetic is negligible (the tests'
tiny random Llama with a 1,024-token vocabulary), ``B`` requests decoding together, and
the median time of the last 32 steps of a second, timed ``generate``: the whole
``LLMEngine.step``, ``ModelRunner.execute`` within it and ``ModelRunner.prepare`` within
that.

    python scripts/host_step_times.py --batch 256 [--profile] [--gc [--freeze] --runs 6]

``--profile`` prints the timed run's top functions by their own time (cProfile).
``--gc`` prints the cyclic collector's passes during the timed runs (``--runs`` of
them), by generation: how many, their median and longest time; a full (generation 2)
pass stalls the step it falls in. ``--freeze`` first freezes what start-up allocated,
as the server and data-parallel replicas do (``process_tuning.freeze_startup_heap``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # for tests.helpers; after site-packages (see scripts/gpu_check.py)
    sys.path.append(str(ROOT))


def _timed(times: list[float], fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        times.append(time.perf_counter() - t0)
        return out

    return wrapper


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--gc", action="store_true", help="report the collector's passes")
    p.add_argument("--freeze", action="store_true", help="freeze the start-up heap first")
    p.add_argument("--runs", type=int, default=1, help="timed generate calls")
    args = p.parse_args(argv)

    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.worker import process_tuning
    from tests.helpers.models import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", vocab_size=1024)
        llm = LLM(model=str(model), dtype="float32", max_num_seqs=max(args.batch, 1),
                  max_model_len=1024, enable_prefix_caching=False, kv_cache_memory_gb=0.5)  # fmt: skip
        runner = llm.engine.worker.runner
        times: dict[str, list[float]] = {"step": [], "execute": [], "prepare": []}
        runner.prepare = _timed(times["prepare"], runner.prepare)
        runner.execute = _timed(times["execute"], runner.execute)
        llm.engine.step = _timed(times["step"], llm.engine.step)
        sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens,
                            min_tokens=args.new_tokens)  # fmt: skip
        prompts = [{"prompt_token_ids": [3 + i % 500, 503 + i % 400, 9 + i % 50] * 20}
                   for i in range(args.batch)]  # fmt: skip
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up
        for v in times.values():
            v.clear()
        if args.freeze:
            process_tuning.freeze_startup_heap()
        passes: dict[int, list[float]] = {0: [], 1: [], 2: []}
        started: dict[int, float] = {}

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started[info["generation"]] = time.perf_counter()
            else:
                passes[info["generation"]].append(time.perf_counter() - started[info["generation"]])

        if args.gc:
            gc.callbacks.append(on_gc)
        prof = cProfile.Profile() if args.profile else None
        if prof is not None:
            prof.enable()
        for _ in range(args.runs):
            llm.generate(prompts, sp, use_tqdm=False)
        if prof is not None:
            prof.disable()
        if args.gc:
            gc.callbacks.remove(on_gc)
        if args.freeze:
            process_tuning.unfreeze_heap()
    med = {k: 1e6 * statistics.median(v[-32:]) for k, v in times.items()}
    print(f"batch {args.batch}: step {med['step']:.0f} us, execute {med['execute']:.0f} us, "
          f"prepare {med['prepare']:.0f} us")  # fmt: skip
    for gen, d in passes.items() if args.gc else ():
        stats = f", median {1e3 * statistics.median(d):.2f} ms, max {1e3 * max(d):.2f} ms" if d else ""
        print(f"gc generation {gen}: {len(d)} passes{stats}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
