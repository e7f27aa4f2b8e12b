"""The cost of the block map's snapshot (``GET /v1/kv_cache/state``).

``snapshot``: time :func:`pagedserve.engine.core.kv_state.take_kv_state` (what the engine thread does
between steps for each poll) and size its JSON body, for pools of 1k to 100k blocks with
32 running requests holding half the pool::

    python -m pagedserve.loadtest.kv_state_bench snapshot [--blocks 1000,10000,100000]

``poll``: poll a running server's state endpoint at a fixed rate, as the page does while
anything runs (4 Hz, ``max_cells=16384``), for a while; run it beside
``pagedserve bench serve`` to see what polling costs the serving throughput::

    python -m pagedserve.loadtest.kv_state_bench poll --url http://127.0.0.1:8000 --hz 4 --seconds 60

``alternate``: the same poller switched on and off in windows of ``--window`` seconds
(order A B B A, A off and B on, so that a steady drift cancels) beside one long
``bench serve`` run, and the engine's output tokens per second in each window, read at
each window's edge from one small snapshot (the engine's own clock and token count).
Pairs of adjacent windows give the throughput with polling over that without it, with
a bootstrap interval, all within one run of one server::

    python -m pagedserve.loadtest.kv_state_bench alternate --url http://127.0.0.1:8000 --seconds 900
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import time
import urllib.request

# ``poll`` imports nothing but the standard library: it runs beside the server it
# measures, on the same cores, so its own start-up (torch, through the engine package)
# must not land in the run it measures. ``snapshot`` imports the engine when it runs.

BLOCK_SIZE = 16
NUM_REQUESTS = 32


def _filled_scheduler(num_blocks: int):
    """32 running requests whose prompts fill half the pool (prefix caching on)."""
    from pagedserve.engine.core.request import Request, RequestGroup
    from pagedserve.engine.core.sampling_params import SamplingParams
    from pagedserve.engine.core.scheduler import Scheduler

    tokens_each = num_blocks * BLOCK_SIZE // 2 // NUM_REQUESTS
    s = Scheduler(num_blocks, BLOCK_SIZE, max_num_seqs=NUM_REQUESTS,
                  max_num_batched_tokens=tokens_each * NUM_REQUESTS + 1,
                  max_model_len=tokens_each + 16, watermark=0.0)  # fmt: skip
    sp = SamplingParams(max_tokens=8)
    for i in range(NUM_REQUESTS):
        prompt = [(i * 7919 + j) % 30000 + 3 for j in range(tokens_each)]
        group = RequestGroup(f"r{i}", None, prompt, sp, 0.0)
        group.members.append(Request(f"r{i}", group, 0, sp, prompt, 8))
        s.add_request(group.members[0])
    s.schedule()  # admits all: every prompt's blocks allocated in one step
    assert s.num_running == NUM_REQUESTS
    return s


def snapshot(args: argparse.Namespace) -> None:
    from pagedserve.engine.core.kv_state import DEFAULT_MAX_CELLS, KVStateTaker
    from pagedserve.server.playground import encode_state

    print(f"python {platform.python_version()}, {platform.processor() or platform.machine()}")
    print("| blocks | max_cells | cells | first snapshot ms | snapshot ms (median of 50) | "
          "JSON bytes | JSON bytes, tables=false |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.blocks.split(",")):
        s = _filled_scheduler(n)
        for max_cells in (DEFAULT_MAX_CELLS, 16384):
            taker = KVStateTaker()  # as the engine thread keeps one
            first = time.perf_counter()
            taker.take(s, 0.0, max_cells)
            first = time.perf_counter() - first
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                st = taker.take(s, 0.0, max_cells)
                times.append(time.perf_counter() - t0)
            size = len(json.dumps(encode_state(st)))
            small = len(json.dumps(encode_state(taker.take(s, 0.0, max_cells, False))))
            print(f"| {n} | {max_cells} | {len(st.cells)} | {first * 1e3:.2f} | "
                  f"{statistics.median(times) * 1e3:.2f} | {size} | {small} |")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def poll(args: argparse.Namespace) -> None:
    url = f"{args.url.rstrip('/')}/v1/kv_cache/state?max_cells={args.max_cells}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    period = 1.0 / args.hz
    end = time.monotonic() + args.seconds
    latencies = []
    next_t = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while time.monotonic() < end:
            t0 = time.monotonic()
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as r:
                r.read()
            latencies.append(time.monotonic() - t0)
            next_t = max(next_t + period, time.monotonic())  # a slow answer skips ticks
            time.sleep(next_t - time.monotonic() if next_t > time.monotonic() else 0.0)
    except KeyboardInterrupt:  # stopped early (SIGINT or SIGTERM): report what it did
        pass
    lat = sorted(latencies) or [0.0]
    print(f"{len(lat)} polls at {args.hz} Hz; latency median {lat[len(lat) // 2] * 1e3:.1f} ms, "
          f"max {lat[-1] * 1e3:.1f} ms")


def _get(url: str, headers: dict) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as r:
        return json.loads(r.read())


def _edge(base: str, headers: dict) -> tuple[float, int]:
    """The engine's clock and output tokens so far (a one-cell snapshot, no tables)."""
    st = _get(f"{base}/v1/kv_cache/state?max_cells=1&tables=false", headers)
    return st["time"], st["counters"]["generation_tokens_total"]


def _pooled_ratio(pairs: list[tuple[dict, dict]]) -> float:
    """Output tok/s over the polled windows of ``pairs`` over that of the unpolled ones."""
    tok = {True: 0, False: 0}
    sec = {True: 0.0, False: 0.0}
    for pair in pairs:
        for w in pair:
            tok[w["on"]] += w["tokens"]
            sec[w["on"]] += w["seconds"]
    return (tok[True] / sec[True]) / (tok[False] / sec[False])


def _bootstrap(pairs: list[tuple[dict, dict]], n: int = 10_000,
               seed: int = 0) -> tuple[float, float]:  # fmt: skip
    import random

    rng = random.Random(seed)
    ratios = sorted(_pooled_ratio(rng.choices(pairs, k=len(pairs))) for _ in range(n))
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def alternate(args: argparse.Namespace) -> None:
    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{base}/v1/kv_cache/state?max_cells={args.max_cells}"
    period = 1.0 / args.hz
    signal.signal(signal.SIGTERM, _interrupt)
    windows: list[dict] = []
    end = time.monotonic() + args.seconds
    try:
        t_prev, tok_prev = _edge(base, headers)
        i = 0
        while time.monotonic() + args.window <= end:
            on = i % 4 in (1, 2)  # A B B A
            stop = time.monotonic() + args.window
            polls = 0
            while time.monotonic() < stop:
                if on:
                    _get(url, headers)
                    polls += 1
                time.sleep(max(0.0, min(period, stop - time.monotonic())))
            t, tok = _edge(base, headers)
            windows.append({"on": on, "seconds": t - t_prev, "tokens": tok - tok_prev,
                            "polls": polls})  # fmt: skip
            t_prev, tok_prev = t, tok
            i += 1
    except KeyboardInterrupt:
        pass
    # Pairs of adjacent windows (A B, then B A) that both saw output: the bench's start
    # and end fall outside them.
    pairs = [(windows[j], windows[j + 1]) for j in range(0, len(windows) - 1, 2)
             if windows[j]["tokens"] > 0 and windows[j + 1]["tokens"] > 0]
    pairs = pairs[args.skip_pairs:]
    summary: dict = {"windows": windows, "skip_pairs": args.skip_pairs}
    if len(pairs) >= 2:
        lo, hi = _bootstrap(pairs)
        ratio = _pooled_ratio(pairs)
        summary.update(pairs=len(pairs), ratio=ratio, ci95=[lo, hi])
        on = [w for p in pairs for w in p if w["on"]]
        rate = sum(w["polls"] for w in on) / sum(w["seconds"] for w in on)
        print(f"{len(pairs)} pairs of {args.window:g} s windows: output tok/s polled / "
              f"unpolled {ratio:.4f} (95% bootstrap over pairs [{lo:.4f}, {hi:.4f}]); "
              f"{rate:.2f} polls/s in the polled windows")
    else:
        print("fewer than two pairs of windows with output tokens")
    if args.save:
        with open(args.save, "w") as f:
            json.dump(summary, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("--blocks", default="1000,10000,100000")
    q = sub.add_parser("poll")
    q.add_argument("--url", default="http://127.0.0.1:8000")
    q.add_argument("--hz", type=float, default=4.0)
    q.add_argument("--seconds", type=float, default=60.0)
    q.add_argument("--max-cells", type=int, default=16384)
    q.add_argument("--api-key", default=None)
    a = sub.add_parser("alternate")
    a.add_argument("--url", default="http://127.0.0.1:8000")
    a.add_argument("--hz", type=float, default=4.0)
    a.add_argument("--window", type=float, default=10.0)
    a.add_argument("--seconds", type=float, default=900.0)
    a.add_argument("--max-cells", type=int, default=16384)
    a.add_argument("--api-key", default=None)
    a.add_argument("--skip-pairs", type=int, default=1,
                   help="pairs left out at the start (the bench's warm-up)")
    a.add_argument("--save", default=None, help="write the windows and pairs as JSON here")
    args = p.parse_args()
    {"snapshot": snapshot, "poll": poll, "alternate": alternate}[args.cmd](args)


if __name__ == "__main__":
    main()
