"""``pagedserve serve --data-parallel-size 2``: two engine processes behind one front end.

The load test of ``tests/loadtest`` against two replicas (200 streams at concurrency 32,
zero failures, both replicas served, each replica's KV cache empty afterwards); the
router's choices; a replica killed mid-run gives 503s and an exit with nothing left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from types import SimpleNamespace

import pytest
import requests

from pagedserve import EngineConfig, PoolingParams, SamplingParams
from pagedserve.engine.loop.async_engine import EngineSnapshot
from pagedserve.engine.loop.dp_engine import PREFIX_MARGIN_TOKENS, DataParallelEngine
from pagedserve.loadtest.datasets import random_dataset, vocabulary_ids
from pagedserve.loadtest.serve_bench import run_benchmark, run_problems, wait_server_idle
from tests.helpers.server import ServerProcess, child_pids, process_alive
from tests.helpers.server_checks import CHAT_PATH, MODEL

SCHEDULE_FIRST = True
"""Among the longest modules of the suite: started first (``tests/conftest.py``)."""

ARGS = ["--data-parallel-size", "2", "--dtype", "float32", "--device", "cpu",
        "--kv-cache-memory-gb", "0.25", "--log-level", "warning"]


def samples_of(text: str, name: str) -> dict[str, float]:
    """``replica -> value`` of a metric's samples (with ``finished_reason="length"`` for
    the success counter)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and ("finished_reason" not in line
                                            or 'finished_reason="length"' in line):
            out[re.search(r'replica="(\d+)"', line).group(1)] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.slow
def test_load_200_streams_on_two_replicas(default_tokenizer):
    samples = random_dataset(vocabulary_ids(default_tokenizer), 200, input_len=24,
                             output_len=12, range_ratio=0.3, seed=1)  # fmt: skip
    with ServerProcess(ARGS) as srv:
        report = asyncio.run(run_benchmark(srv.url, samples, endpoint="/v1/completions",
                                           max_concurrency=32, seed=0))  # fmt: skip
        idle = asyncio.run(wait_server_idle(srv.url, timeout=15.0))
        text = requests.get(srv.url + "/metrics").text
    summary = {k: v for k, v in report.items() if k != "requests"}
    assert run_problems(report) + idle == [], json.dumps(summary, indent=1)
    assert report["successful_requests"] == 200
    assert report["total_output_tokens"] == sum(s.expected_output_len for s in samples)
    served = samples_of(text, "pagedserve:request_success_total")
    assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
    assert sum(served.values()) == 200
    assert samples_of(text, "pagedserve:kv_cache_usage_perc") == {"0": 0.0, "1": 0.0}


def _router(default_model_path, prefix_caching: bool = True,
            sent: list | None = None) -> DataParallelEngine:
    """A front end over two stand-in replicas; ``sent`` collects what each was given."""
    ready = {"model_name": MODEL, "model_path": str(default_model_path),
             "eos_token_ids": (2,), "max_num_seqs": 8,
             "limits": SimpleNamespace(max_model_len=4096, vocab_size=49152), "lora": None,
             "pooling_defaults": PoolingParams()}
    replicas = [SimpleNamespace(ready=ready, snapshot=EngineSnapshot(), queues={},
                                add_request=lambda *a, i=i: sent is not None and sent.append(
                                    (i, a))) for i in range(2)]  # fmt: skip
    cfg = EngineConfig(enable_prefix_caching=prefix_caching)
    return DataParallelEngine(cfg, replicas)


def test_router_balances_and_follows_prefixes(default_model_path):
    dp = _router(default_model_path)
    sp = SamplingParams(max_tokens=100)
    shared = list(range(100, 132))  # two blocks of a shared system prompt
    dp.add_request("a", shared + [1], sp, asyncio.Queue())
    dp.add_request("b", [5] * 40, sp, asyncio.Queue())  # least loaded: the other one
    assert dp._owner == {"a": 0, "b": 1}
    dp.add_request("c", [7] * 200, sp, asyncio.Queue())  # replica 1 now leads by 160 tokens
    assert dp._owner["c"] == 0
    dp.add_request("d", shared + [2, 3], sp, asyncio.Queue())  # holder 0, within the margin
    assert dp._owner["d"] == 0
    assert dp.load[0] - dp.load[1] < PREFIX_MARGIN_TOKENS + 400
    dp.load[0] += PREFIX_MARGIN_TOKENS  # the holder is now too busy
    dp.add_request("e", shared + [4], sp, asyncio.Queue())
    assert dp._owner["e"] == 1
    for rid in "abcde":
        dp._finished(rid)
    assert dp.load == [PREFIX_MARGIN_TOKENS, 0] and dp._owner == {}


def test_router_follows_a_prefix_only_within_its_cache_salt(default_model_path):
    sent: list = []
    dp = _router(default_model_path, sent=sent)
    sp = SamplingParams(max_tokens=100)
    shared = list(range(100, 132))
    dp.add_request("a", shared, sp, asyncio.Queue(), cache_salt="x")
    # The same first block under another salt (or none) shares no cached block with "a":
    # each goes to the least loaded replica.
    dp.add_request("b", shared, sp, asyncio.Queue(), cache_salt="y")
    dp.add_request("c", shared, sp, asyncio.Queue())
    assert [dp._owner[r] for r in "abc"] == [0, 1, 0]
    # Each salt's prefix is followed to its holder while that one is busier (within the
    # margin) than the other replica.
    dp.load[1] += 300  # replica 1, y's holder, is now the busier one
    dp.add_request("d", shared + [1], sp, asyncio.Queue(), cache_salt="y")
    dp.load[0] += 600
    dp.add_request("e", shared + [2], sp, asyncio.Queue(), cache_salt="x")
    assert (dp._owner["d"], dp._owner["e"]) == (1, 0)
    assert dp.load[0] - dp.load[1] < PREFIX_MARGIN_TOKENS
    # Each replica is sent the request's salt (the last field of its "add").
    assert [(i, a[0], a[-1]) for i, a in sent] == [
        (0, "a", "x"), (1, "b", "y"), (0, "c", None), (1, "d", "y"), (0, "e", "x")]


def test_router_without_prefix_caching_only_balances(default_model_path):
    dp = _router(default_model_path, prefix_caching=False)
    sp = SamplingParams(max_tokens=10)
    for i in range(4):
        dp.add_request(f"r{i}", list(range(100, 140)), sp, asyncio.Queue())
    assert [dp._owner[f"r{i}"] for i in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_router_keeps_an_adapter_on_one_replica(default_model_path, prefix_caching):
    """Requests of one LoRA adapter go where it already runs (loaded there, within that
    replica's max_loras) while that replica is not too busy; prefixes are per adapter."""
    from pagedserve.engine.lora import LoRARequest

    dp = _router(default_model_path, prefix_caching)
    sp = SamplingParams(max_tokens=10)
    sql, doc = LoRARequest("sql", 1, "/a/sql"), LoRARequest("doc", 2, "/a/doc")
    shared = list(range(100, 132))
    for i in range(4):
        dp.add_request(f"s{i}", [7, 8, i], sp, asyncio.Queue(), lora_request=sql)
        dp.add_request(f"d{i}", [7, 8, i], sp, asyncio.Queue(), lora_request=doc)
    assert {dp._owner[f"s{i}"] for i in range(4)} == {0}
    assert {dp._owner[f"d{i}"] for i in range(4)} == {1}
    # A long prompt new to the router follows its adapter too; the same first block
    # under another adapter is another prefix (one key would have sent p-doc after p-sql).
    dp.add_request("p-sql", shared, sp, asyncio.Queue(), lora_request=sql)
    dp.add_request("p-doc", shared, sp, asyncio.Queue(), lora_request=doc)
    assert (dp._owner["p-sql"], dp._owner["p-doc"]) == (0, 1)
    dp.load[0] += PREFIX_MARGIN_TOKENS + 100  # sql's replica too busy: balance wins
    dp.add_request("s-late", [7, 8, 9], sp, asyncio.Queue(), lora_request=sql)
    assert dp._owner["s-late"] == 1
    dp.load[0] -= PREFIX_MARGIN_TOKENS + 100  # ... and the adapter now lives there
    dp.add_request("s-later", [7, 8, 10], sp, asyncio.Queue(), lora_request=sql)
    assert dp._owner["s-later"] == 1


def test_killed_replica_gives_503_and_leaves_nothing(default_model_path):
    srv = ServerProcess(ARGS).start()
    try:
        pids = child_pids(srv.pid)
        assert len(pids) == 2, pids
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1000, "ignore_eos": True, "stream": True}  # fmt: skip
        with requests.post(srv.url + CHAT_PATH, json=body, stream=True) as r:
            lines = r.iter_lines()
            next(line for line in lines if b'"content":"' in line)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            tail = b"\n".join(lines)
        assert b'"error"' in tail and tail.rstrip().endswith(b"data: [DONE]")
        assert time.monotonic() - t0 < 5
        assert srv.wait(30) == 1
    finally:
        srv.kill()
    assert not any(process_alive(p) for p in pids)
