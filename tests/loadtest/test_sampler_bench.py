"""``python -m pagedserve.loadtest.sampler_bench``: both ways of top_p, timed and compared."""

from __future__ import annotations

from pagedserve.loadtest import sampler_bench


def test_bench_times_both_ways_and_says_which_sorted(capsys) -> None:
    rows = sampler_bench.bench(vocabs=(4096,), rows=(1, 3), scale=5.0, iters=2)
    assert [(r["vocab"], r["rows"]) for r in rows] == [(4096, 1), (4096, 3)]
    assert all(r["candidates_only"] and r["sort_ms"] > 0 and r["candidates_ms"] > 0 for r in rows)
    flat = sampler_bench.bench(vocabs=(4096,), rows=(1,), scale=0.1, iters=1)
    assert not flat[0]["candidates_only"]  # a flat distribution sorts the whole vocabulary
    assert sampler_bench.main(["--vocabs", "4096", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "vocab   4096, 8 rows" in out and "the candidates only" in out
