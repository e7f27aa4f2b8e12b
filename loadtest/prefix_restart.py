"""``pagedserve bench prefix --restart``: the KV block store across a restart and under
eviction, and what a store that never hits costs.

Three parts, on one long shared document (``--doc-len`` tokens) and a store directory
(``--kv-store-dir``, a temporary one by default):

* **restart**: a fresh engine with the store computes the document and a question (the
  cold TTFT), then the same document with three other questions (pool hits: the
  median is kept), and shuts down (its pool's blocks go to the store). The page cache is dropped for the store's
  files (``posix_fadvise(DONTNEED)``), as after a reboot or on a new host with the same
  volume, and a new engine asks the first question again: its TTFT, its answer against
  the cold answer, and the store's read rate against a plain read of the same files.
* **evicted**: an engine whose pool holds the document only just, with an empty store,
  computes the document, then serves competing requests that evict it (the pool hands
  its blocks to the store), then asks again: the blocks come back from what the pool kept
  and from the store, against the pool hit above.
* **zero reuse**: random prompts sharing nothing, through a pool small enough to evict
  all the time, with the store and without it (caching on in both), alternating.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedserve.loadtest.bench_common import engine_kwargs, run_engine, warm_up
from pagedserve.loadtest.workloads import Workload, fixed_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the restart scenario (``bench prefix --restart``)."""
    g = parser.add_argument_group("restart scenario (--restart)")
    g.add_argument("--restart", action="store_true",
                   help="run the KV store scenario (restart, eviction, zero reuse) instead "
                        "of the shared-prefix and zero-reuse comparisons")  # fmt: skip
    g.add_argument("--doc-len", type=int, default=7800, help="shared document tokens")
    g.add_argument("--restart-question-len", type=int, default=24)
    g.add_argument("--restart-output-len", type=int, default=16)
    g.add_argument("--kv-store-dir", default=None,
                   help="store directory (default: a temporary one, removed afterwards)")
    g.add_argument("--kv-store-gb", type=float, default=2.0)
    g.add_argument("--competing-requests", type=int, default=4)
    g.add_argument("--competing-len", type=int, default=512)
    g.add_argument("--spare-blocks", type=int, default=48,
                   help="blocks beyond the document's in the evicted part's pool")
    g.add_argument("--zero-reuse-max-num-seqs", type=int, default=8)


def _ask(llm, prompt: list[int], output_len: int) -> dict[str, Any]:
    """One greedy request stepped alone on the engine: its TTFT (the engine's own
    ``metrics.time_to_first_token``), its tokens and its cached prompt tokens."""
    from pagedserve.engine.core.sampling_params import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    rid = eng.add_request(None, prompt, sp).request_id
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None and final.metrics.time_to_first_token is not None
    return {"ttft_s": final.metrics.time_to_first_token,
            "tokens": list(final.outputs[0].token_ids),
            "cached_tokens": final.num_cached_tokens}


def _drop_page_cache(root: Path) -> int:
    """Ask the kernel to drop the cached pages of every file under ``root``; returns the
    bytes of those files."""
    total = 0
    for path in root.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            total += os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return total


def _plain_read_rate(root: Path) -> dict[str, float]:
    """Bytes per second of reading the store's files one after another with plain reads,
    after dropping their cached pages: the disk's rate for this access pattern."""
    nbytes = _drop_page_cache(root)
    files = sorted(root.rglob("*.kvb"))
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
    dt = time.perf_counter() - t0
    return {"files": len(files), "bytes": nbytes, "seconds": dt,
            "bytes_per_s": nbytes / dt if dt else 0.0}


def _store_read(stats: dict[str, int], before: dict[str, int]) -> dict[str, float]:
    """What the store read from the disk between two counter snapshots, and how fast."""

    def moved(name: str) -> int:
        return stats.get(name, 0) - before.get(name, 0)

    nbytes = moved("disk_bytes_read")
    secs = moved("store_load_ns") / 1e9
    return {"blocks": moved("disk_loads"), "bytes": nbytes, "seconds": secs,
            "bytes_per_s": nbytes / secs if secs else 0.0}


def _llm(args, **overrides):
    from pagedserve.engine.loop.llm import LLM

    return LLM(model=args.model, **engine_kwargs(args, **overrides))


def _close(llm) -> None:
    llm.close()
    del llm
    gc.collect()


def _zero_reuse(args, token_ids: list[int], store_dir: Path) -> dict[str, Any]:
    bs = args.block_size
    per_req = -(-(args.zero_reuse_input_len + args.zero_reuse_output_len) // bs)
    pool = int(per_req * args.zero_reuse_max_num_seqs * 1.5)
    work: Workload = fixed_workload(token_ids, args.num_requests, args.zero_reuse_input_len,
                                    args.zero_reuse_output_len, args.seed + 1)  # fmt: skip
    common = {"max_num_seqs": args.zero_reuse_max_num_seqs, "num_gpu_blocks_override": pool}
    runs: list[dict[str, Any]] = []
    for i in range(args.repeats):
        pair = {}
        for with_store in ((True, False) if i % 2 == 0 else (False, True)):
            d = store_dir / f"zero-{i}"
            extra = {"kv_store_dir": str(d), "kv_store_gb": args.kv_store_gb} if with_store else {}
            llm = _llm(args, **common, **extra)
            if args.warmup:
                warm_up(llm, token_ids, args.seed)
            cpu0 = time.process_time()
            run = run_engine(llm, work)
            if with_store:
                llm.engine.kv_store.store.flush()  # the writes it queued count too
            cpu = time.process_time() - cpu0
            stats = llm.engine.kv_store_stats() if with_store else {}
            _close(llm)
            shutil.rmtree(d, ignore_errors=True)
            pair["store" if with_store else "no_store"] = {
                "elapsed_s": run.elapsed_s, "cpu_s": cpu, "hit_rate": run.hit_rate,
                "store_saved": stats.get("tier_saved", 0),
                "store_hits": stats.get("tier_hits", 0)}  # fmt: skip
            label = "with store" if with_store else "no store  "
            print(f"  #{i + 1} {label} {run.elapsed_s:8.2f} s  CPU {cpu:7.2f} s  pool hit rate "
                  f"{100 * run.hit_rate:5.1f}%"
                  + (f"  saved to the store {stats.get('tier_saved', 0)}, store hits "
                     f"{stats.get('tier_hits', 0)}" if with_store else ""))
        runs.append(pair)
    costs = [p["store"]["elapsed_s"] / p["no_store"]["elapsed_s"] - 1 for p in runs]
    cpu_costs = [p["store"]["cpu_s"] / p["no_store"]["cpu_s"] - 1 for p in runs]
    out = {"pool_blocks": pool, "max_num_seqs": args.zero_reuse_max_num_seqs, "runs": runs,
           "cost_per_pair": costs, "cost_median": statistics.median(costs),
           "cpu_cost_per_pair": cpu_costs, "cpu_cost_median": statistics.median(cpu_costs)}
    print(f"zero-reuse cost of the store: median {100 * out['cost_median']:+.2f}% over "
          f"{len(costs)} pairs (" + ", ".join(f"{100 * c:+.2f}%" for c in costs) + "); "
          f"process CPU time {100 * out['cpu_cost_median']:+.2f}% ("
          + ", ".join(f"{100 * c:+.2f}%" for c in cpu_costs) + ")")
    return out


def run_restart(args, token_ids: list[int]) -> dict[str, Any]:
    """The three parts (see the module docstring); prints and returns their numbers."""
    import random

    rng = random.Random(args.seed + 17)
    doc = [rng.choice(token_ids) for _ in range(args.doc_len)]
    q1 = [rng.choice(token_ids) for _ in range(args.restart_question_len)]
    q2 = [rng.choice(token_ids) for _ in range(args.restart_question_len)]
    out_len = args.restart_output_len
    own_dir = args.kv_store_dir is None
    base = Path(tempfile.mkdtemp(prefix="pagedserve-kvstore-")) if own_dir \
        else Path(args.kv_store_dir)  # fmt: skip
    store_dir = base / "doc"
    shutil.rmtree(store_dir, ignore_errors=True)
    store = {"kv_store_dir": str(store_dir), "kv_store_gb": args.kv_store_gb}
    report: dict[str, Any] = {"doc_len": args.doc_len, "question_len": len(q1),
                              "output_len": out_len, "store_dir": str(base)}  # fmt: skip
    try:
        print("-- restart --")
        llm = _llm(args, **store)
        if args.warmup:
            warm_up(llm, token_ids, args.seed)
        cold = _ask(llm, doc + q1, out_len)
        hits = [_ask(llm, doc + q, out_len) for q in (q2, q2[::-1], q1[::-1])]
        hit = sorted(hits, key=lambda h: h["ttft_s"])[1]  # the median of three questions
        _close(llm)  # the pool's blocks are written to the store
        on_disk = _drop_page_cache(store_dir)
        llm = _llm(args, **store)
        if args.warmup:
            warm_up(llm, token_ids, args.seed)
        _drop_page_cache(store_dir)
        before = llm.engine.kv_store_stats()  # the warm-up may read blocks of its own
        again = _ask(llm, doc + q1, out_len)
        read = _store_read(llm.engine.kv_store_stats(), before)
        _close(llm)
        plain = _plain_read_rate(store_dir)
        same = again["tokens"] == cold["tokens"]
        report["restart"] = {
            "cold": cold, "pool_hit": hit, "after_restart": again, "identical_answer": same,
            "ttft_restart_over_cold": again["ttft_s"] / cold["ttft_s"],
            "store_bytes_on_disk": on_disk, "store_read": read, "plain_read": plain}
        print(f"cold prefill TTFT {cold['ttft_s']:8.3f} s  ({len(doc) + len(q1)} tokens)")
        print(f"pool hit TTFT     {hit['ttft_s']:8.3f} s  (cached {hit['cached_tokens']}; "
              f"median of {len(hits)} questions: "
              + ", ".join(f"{h['ttft_s']:.3f}" for h in hits) + ")")
        print(f"after restart     {again['ttft_s']:8.3f} s  (cached {again['cached_tokens']}) = "
              f"{100 * again['ttft_s'] / cold['ttft_s']:.2f}% of cold; answer "
              f"{'identical' if same else 'DIFFERENT'}")
        print(f"store read {read['bytes'] / 2**20:.1f} MiB in {read['seconds']:.3f} s = "
              f"{read['bytes_per_s'] / 2**30:.2f} GiB/s; plain read of the same "
              f"{plain['files']} files (page cache dropped) {plain['bytes_per_s'] / 2**30:.2f}"
              f" GiB/s")

        print("-- evicted --")
        bs = args.block_size
        doc_blocks = -(-(len(doc) + len(q2) + out_len) // bs)
        pool = doc_blocks + args.spare_blocks
        fresh = {**store, "kv_store_dir": str(base / "evicted")}  # the pool hands them over
        llm = _llm(args, **fresh, num_gpu_blocks_override=pool)
        first = _ask(llm, doc + q2, out_len)
        competing = [[rng.choice(token_ids) for _ in range(args.competing_len)]
                     for _ in range(args.competing_requests)]  # fmt: skip
        before = llm.engine.kv_store_stats()
        for p in competing:
            _ask(llm, p, out_len)
        evicted = llm.engine.kv_store_stats()["tier_saved"] - before["tier_saved"]
        back = _ask(llm, doc + q1, out_len)
        stats = llm.engine.kv_store_stats()
        _close(llm)
        placed = stats["tier_placed"] - before["tier_placed"]
        report["evicted"] = {
            "pool_blocks": pool, "first": first, "competing_requests": len(competing),
            "blocks_handed_to_store": evicted, "blocks_read_back": placed, "again": back,
            "identical_answer": back["tokens"] == cold["tokens"],
            "ttft_over_pool_hit": back["ttft_s"] / hit["ttft_s"]}
        print(f"pool of {pool} blocks; {len(competing)} competing requests of "
              f"{args.competing_len} tokens handed {evicted} of the document's blocks to "
              f"the store")
        print(f"asked again: TTFT {back['ttft_s']:.3f} s (cached {back['cached_tokens']}, "
              f"{placed} blocks read back) = {back['ttft_s'] / hit['ttft_s']:.2f}x the pool "
              f"hit; answer {'identical' if back['tokens'] == cold['tokens'] else 'DIFFERENT'}")

        print("-- zero reuse, with and without the store --")
        report["zero_reuse"] = _zero_reuse(args, token_ids, base)
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)
    return report
