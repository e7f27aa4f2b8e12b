"""The cost of structured outputs: per decode step, filling and applying the grammar
bitmask of the constrained rows against the step time, at batch 1 and 32; and grammar
compile time, cold and cached.

    python -m loadtest.structured_bench [--steps 20]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.structured import bitmask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}


def _decode_step_s(llm: LLM, batch: int, steps: int) -> float:
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", [1, 2, 3 + i], sp)
    times = []
    while eng.has_unfinished_requests():
        eng.step()
        st = eng.last_step
        if st is not None and st.num_decodes == batch:
            times.append(st.execute_s)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    llm = LLM(dtype="float32", kv_cache_memory_gb=0.5)
    mgr = llm.engine.structured
    spec = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    mgr.submit(spec).result()
    cold = time.perf_counter() - t0  # includes building the backend's tokenizer tables
    t0 = time.perf_counter()
    mgr.submit(StructuredOutputsParams(regex="[0-9]{3}-[a-z]{4}")).result()
    cold2 = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        mgr.submit(spec).result()
    cached = (time.perf_counter() - t0) / 100
    print(f"cpu: {platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, backend {mgr.backend_name}")
    print(f"compile: first (with tokenizer tables) {cold * 1e3:.0f} ms, next cold "
          f"{cold2 * 1e3:.1f} ms, cached {cached * 1e6:.1f} us")
    vocab = llm.engine.vocab_size
    for batch in (1, 32):
        step = _decode_step_s(llm, batch, args.steps)
        matchers = [mgr.matcher(spec) for _ in range(batch)]
        logits = torch.randn(batch, vocab)
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            bm = bitmask.fill(matchers, vocab)
            bitmask.apply(logits, list(range(batch)), bm)
        mask = (time.perf_counter() - t0) / reps
        print(f"batch {batch:2d}: decode step {step * 1e3:.2f} ms, mask fill+apply "
              f"{mask * 1e3:.3f} ms for {batch} constrained rows = {100 * mask / step:.1f}%")


if __name__ == "__main__":
    main()
