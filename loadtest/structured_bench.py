"""The cost of structured outputs on a decode step, and grammar compile time.

Per batch size (1 and 32), rounds alternate a batch of requests constrained by a JSON
schema with the same batch unconstrained (both greedy, same prompts), so that load from
other processes falls on both alike. Each whole engine step in which every request
decodes is timed by the wall clock and by the process's CPU time (all its threads,
spinning ones included). Reported: the best and the median step of each kind and their
ratios, and the bitmask fill and apply alone (best of N, this thread's CPU time). Then
grammar compile time: the first compile (which builds the backend's tokenizer tables),
another cold spec, and a cached one. Last, a plain request beside the heaviest structured
request a client may send (``n=16``, a string of up to 100k characters): the plain
request's latency alone, beside an unconstrained ``n=16`` group and beside the
structured one, and their ratios (target: beside the structured group within 2x alone; on
a CPU, where 17 rows cost several times one, the grammar's share is the ratio to the
unconstrained group).

    python -m pagedserve.loadtest.structured_bench [--rounds 6] [--steps 12] [--backend xgrammar]
        [--beside-rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.engine.structured import bitmask
from pagedserve.loadtest.bench_common import cpu_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
LONG = {"type": "array", "items": {"type": "integer"}, "minItems": 40}
"""A schema that cannot end within the timed steps (at least 80 tokens)."""
_IDS = itertools.count()
PROMPTS = ["List some numbers as JSON:", "The weather today is", "def f(x):", "Once upon"]


def _run_batch(llm: LLM, batch: int, steps: int, constrained: bool,
               wall: list[float], cpu: list[float]) -> None:
    eng = llm.engine
    so = StructuredOutputsParams(json=LONG) if constrained else None
    sp = SamplingParams(temperature=0, max_tokens=steps, structured_outputs=so,
                        ignore_eos=not constrained)
    tag = "c" if constrained else "u"
    tok = llm.get_tokenizer()
    for i in range(batch):
        ids = tok.encode(PROMPTS[i % len(PROMPTS)]) + [i]  # distinct: no shared prefix
        eng.add_request(f"{tag}{batch}-{next(_IDS)}", ids, sp)
    while eng.has_unfinished_requests():
        w0, c0 = time.perf_counter(), time.process_time()
        eng.step()
        w1, c1 = time.perf_counter(), time.process_time()
        st = eng.last_step
        if st is not None and st.num_decodes == batch == st.num_requests:
            wall.append(w1 - w0)
            cpu.append(c1 - c0)


def _mask_cost(llm: LLM, batch: int, reps: int = 30) -> float:
    """Best-of-``reps`` thread CPU time of filling and applying ``batch`` masks."""
    mgr, vocab = llm.engine.structured, llm.engine.settings.vocab_size
    matchers = [mgr.matcher(StructuredOutputsParams(json=LONG)) for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    tb = bitmask.TokenBitmask()
    best = float("inf")
    for _ in range(reps):
        x = logits.clone()
        t0 = time.thread_time()
        bitmask.apply(x, None, tb.fill(matchers, vocab))
        best = min(best, time.thread_time() - t0)
    return best


HEAVY = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 100000}},
         "required": ["s"]}
"""The heavy structured request: a string of up to 100k characters, ``n=16``."""


def _plain_latency(llm: LLM, beside: StructuredOutputsParams | None | bool,
                   max_tokens: int = 16) -> float:
    """Wall time of one plain greedy request of ``max_tokens`` tokens, alone
    (``beside=False``) or beside an ``n=16`` group (unconstrained with ``None``, else
    under ``beside``) that starts with it and outlasts it."""
    eng, tok = llm.engine, llm.get_tokenizer()
    tag = next(_IDS)
    if beside is not False:
        group = SamplingParams(n=16, temperature=1.0, seed=tag, max_tokens=8 * max_tokens,
                               structured_outputs=beside or None)
        eng.add_request(f"heavy-{tag}", tok.encode("Write a long story as JSON:"), group)
        if beside:  # its grammar compiles before the clock starts (a cached spec)
            llm.engine.structured.submit(beside).result()
    rid = f"plain-{tag}"
    t0 = time.perf_counter()
    eng.add_request(rid, tok.encode(PROMPTS[tag % len(PROMPTS)]),
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while True:
        done = [o for o in eng.step() if o.request_id == rid and o.finished]
        if done:
            break
    latency = time.perf_counter() - t0
    for r in list(eng.output.groups):
        eng.abort_request(r)
    while eng.has_unfinished_requests():
        eng.step()
    return latency


def _beside_heavy(llm: LLM, rounds: int) -> None:
    heavy = StructuredOutputsParams(json=HEAVY)
    llm.engine.structured.submit(heavy).result()
    _plain_latency(llm, False, 3)  # warm-up
    alone, unconstrained, structured = [], [], []
    for _ in range(rounds):
        alone.append(_plain_latency(llm, False))
        unconstrained.append(_plain_latency(llm, None))
        structured.append(_plain_latency(llm, heavy))
    med = statistics.median
    a, u, c = med(alone), med(unconstrained), med(structured)
    print(f"plain request (16 tokens), median of {rounds}: alone {a * 1e3:.0f} ms, beside an "
          f"unconstrained n=16 group {u * 1e3:.0f} ms = {u / a:.2f}x, beside n=16 with a "
          f"maxLength 100000 string (backend {llm.engine.structured.backend_name}) "
          f"{c * 1e3:.0f} ms = {c / a:.2f}x alone, {c / u:.2f}x beside the unconstrained group")


def _compile_times(llm: LLM) -> tuple[float, float, float]:
    mgr = llm.engine.structured
    spec = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    mgr.submit(spec).result()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    mgr.submit(StructuredOutputsParams(regex="[0-9]{3}-[a-z]{4}")).result()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        mgr.submit(spec).result()
    return first, cold, (time.perf_counter() - t0) / 100


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--backend", default="xgrammar", choices=("auto", "xgrammar", "llguidance"))
    ap.add_argument("--beside-rounds", type=int, default=3,
                    help="rounds of the plain-beside-heavy-structured case (0: skip)")
    ap.add_argument("--only-beside", action="store_true",
                    help="run only the plain-beside-heavy-structured case")
    args = ap.parse_args()
    llm = LLM(dtype="float32", kv_cache_memory_gb=0.5, structured_outputs_backend=args.backend)
    if args.only_beside:
        _beside_heavy(llm, args.beside_rounds)
        return
    first, cold, cached = _compile_times(llm)
    llm.engine.structured.submit(StructuredOutputsParams(json=LONG)).result()
    print(f"cpu: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"backend {args.backend}; load average {os.getloadavg()[0]:.1f}")
    print(f"compile: first (with tokenizer tables) {first * 1e3:.0f} ms, next cold "
          f"{cold * 1e3:.1f} ms, cached {cached * 1e6:.1f} us")
    for batch in (1, 32):
        runs = {True: ([], []), False: ([], [])}
        _run_batch(llm, batch, 3, False, [], [])  # warm-up
        for _ in range(args.rounds):
            for constrained in (True, False):
                _run_batch(llm, batch, args.steps, constrained, *runs[constrained])
        (cw, cc), (uw, uc) = runs[True], runs[False]
        med = statistics.median
        mask = _mask_cost(llm, batch)
        print(f"batch {batch:2d}, constrained / none over {len(cw)} / {len(uw)} steps: "
              f"best wall {min(cw) * 1e3:.1f} / {min(uw) * 1e3:.1f} ms = "
              f"{min(cw) / min(uw):.3f}, best cpu {min(cc) * 1e3:.1f} / {min(uc) * 1e3:.1f} ms "
              f"= {min(cc) / min(uc):.3f}; median wall {med(cw) * 1e3:.1f} / "
              f"{med(uw) * 1e3:.1f} ms = {med(cw) / med(uw):.3f}, median cpu "
              f"{med(cc) * 1e3:.1f} / {med(uc) * 1e3:.1f} ms = {med(cc) / med(uc):.3f}; "
              f"mask fill+apply alone {mask * 1e3:.2f} ms = {100 * mask / min(uw):.1f}% of "
              "the best step")
    if args.beside_rounds:
        _beside_heavy(llm, args.beside_rounds)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
