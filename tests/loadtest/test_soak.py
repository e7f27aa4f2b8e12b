"""``pagedserve bench soak``, shortened: every request ends in a counted outcome, none is
a 5xx or lost, and nothing is left running or in the KV cache. The traffic mixes chat,
completions, Responses with its store, embeddings, structured outputs, tool calls and
requests through LoRA adapters loaded and unloaded under it."""

from __future__ import annotations

import argparse
import json

from pagedserve.loadtest import soak


def test_short_soak_against_a_tiny_model(tiny_model_factory, tmp_path, capsys):
    p = argparse.ArgumentParser()
    soak.add_arguments(p)
    out = tmp_path / "soak.json"
    args = p.parse_args([
        "--duration", "12s", "--burst-every", "4", "--burst-size", "24", "--concurrency", "4",
        "--max-tokens", "8", "--lora-every", "2", "--save-result", str(out),
        "--server-args", f"--model {tiny_model_factory('llama')} --max-model-len 256 "
                         "--kv-cache-memory-gb 0.05 --max-num-seqs 4 --max-waiting-requests 8 "
                         "--dtype float32 --log-level warning"])
    report = soak.main(args)
    assert report == json.loads(out.read_text())
    outcomes = report["outcomes"]
    assert outcomes.get("ok", 0) > 0 and outcomes.get("bad_request_refused", 0) > 0
    assert outcomes.get("rate_limited", 0) > 0  # the bursts pass the waiting limit
    assert report["server_errors"] == 0 and report["lost"] == 0, outcomes
    assert set(outcomes) <= {"ok", "bad_request_refused", "rate_limited", "client_disconnect",
                             "lora_unloaded"}
    kinds = report["kinds"]
    assert all(kinds.get(k, 0) > 0 for k in ("structured", "tools", "lora", "responses",
                                             "embed")), kinds
    # adapters came and went under the traffic, each load and unload answered
    ops = report["lora_ops"]
    assert ops.get("load_ok", 0) >= 3 and ops.get("unload_ok", 0) >= 1, ops
    assert set(ops) <= {"load_ok", "unload_ok"}, ops
    assert report["end_state"] == {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0,
                                   "num_requests_waiting": 0.0}
    assert report["health"]["probes"] > 50 and report["health"]["failed"] == 0
    assert report["rss"]["start_mb"] > 0 and report["fds"]["end"] > 0
    assert report["server_exit_status"] == 0
    assert "server errors (5xx): 0   lost: 0" in capsys.readouterr().out
