"""top_p's cost by vocabulary size: ``python -m pagedserve.loadtest.sampler_bench``.

The sampler's top_p (:func:`pagedserve.engine.sample.sampler.top_p_drop`) sorts only the
most likely tokens when they hold the mass it keeps, and the whole vocabulary otherwise.
For the vocabularies of the models people serve (SmolLM2's 49,152, Llama 3's 128,256,
Qwen's 151,936, Gemma 3's 262,144), at 1 and 8 sampled rows, this times both ways on the
same probabilities (random logits times ``--scale``, over temperature 0.7: the larger
the scale, the more peaked, as a chat model's next-token distribution is) and checks
they drop the same tokens. Best of ``--iters``, milliseconds.
"""

from __future__ import annotations

import argparse
import time

import torch

VOCABS = (49152, 128256, 151936, 262144)


def bench(vocabs=VOCABS, rows=(1, 8), scale: float = 5.0, top_p: float = 0.95,
          iters: int = 20) -> list[dict]:  # fmt: skip
    """One dict a (vocabulary, rows) case: the times of the whole sort and of the
    candidates' path, and whether the latter sorted only the candidates."""
    from pagedserve.engine.sample.sampler import TOP_P_CANDIDATES, top_p_drop

    out = []
    for v in vocabs:
        for n in rows:
            g = torch.Generator().manual_seed(0)
            probs = torch.softmax(torch.randn(n, v, generator=g) * scale / 0.7, dim=-1)
            p = torch.full((n,), top_p)
            times, drops = {}, {}
            for name, candidates in (("sort", 0), ("candidates", TOP_P_CANDIDATES)):
                best = float("inf")
                for _ in range(iters):
                    t0 = time.perf_counter()
                    drops[name] = top_p_drop(probs, p, candidates)
                    best = min(best, time.perf_counter() - t0)
                times[name] = best * 1e3
            if not torch.equal(drops["sort"], drops["candidates"]):
                raise AssertionError(f"vocabulary {v}, {n} rows: the two ways drop different tokens")
            head = probs.topk(min(TOP_P_CANDIDATES, v), dim=-1).values[:, :-1].sum(-1)
            out.append({"vocab": v, "rows": n, "sort_ms": times["sort"],
                        "candidates_ms": times["candidates"],
                        "candidates_only": bool((head >= top_p).all())})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=5.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    args = parser.parse_args(argv)
    vocabs = [int(v) for v in args.vocabs.split(",")]
    print(f"top_p {args.top_p}, logits scale {args.scale}, {torch.get_num_threads()} threads; "
          f"ms, best of {args.iters}")
    for r in bench(vocabs, scale=args.scale, top_p=args.top_p, iters=args.iters):
        how = "the candidates only" if r["candidates_only"] else "the whole vocabulary"
        print(f"vocab {r['vocab']:>6}, {r['rows']} rows: whole sort {r['sort_ms']:7.2f}  "
              f"top_p_drop {r['candidates_ms']:7.2f}  ({how} sorted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
