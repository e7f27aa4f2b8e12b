"""``pagedserve bench memory``: what it reports on small runs."""

from __future__ import annotations

import argparse

from pagedserve.loadtest import memory_bench


def args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    memory_bench.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_kv_window_reports_the_windowed_cache_against_a_full_one():
    """Six layers, one full: a 600-token request ends holding its full table and about a
    window and a chunk per sliding group, far under six full tables."""
    r = memory_bench.kv_window_memory(args(prompt_len=600, num_layers=6, window=32,
                                           num_kv_heads=1, head_dim=32,
                                           max_num_batched_tokens=64,
                                           kv_cache_memory_gb=0.05))  # fmt: skip
    assert r["kv_groups"] == ["full", 32, 32, 32, 32, 32] and r["group_size"] == 1
    full_blocks = -(-608 // 16)
    assert r["end_blocks"] <= full_blocks + 5 * (-(-(31 + 64) // 16) + 1)
    assert r["end_over_full"] < 0.35 and r["peak_over_full"] < 0.4
    assert r["full_attention_cache_bytes"] == full_blocks * 6 * 2 * 16 * 32 * 4


def test_gguf_memory_counts_the_kept_blocks(default_model_path):
    from pagedserve.engine.loader import default_gguf_path

    r = memory_bench.gguf_memory(str(default_gguf_path()))
    assert r["quant"] == "gguf (q4_1, q8_0)"
    assert set(r["gguf_bytes_by_type"]) == {"F32", "Q4_1", "Q8_0"}
    assert 1.0 <= r["weights_over_file"] < 1.15  # the blocks as stored, not float32
