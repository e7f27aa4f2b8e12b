"""Faults in the KV block store seen through the engine: block files damaged or deleted
between runs, a disk that fails every write, a process killed with SIGKILL while its
store writes. Each gives the outputs computed without a store, with the skip counted and
logged, and never an error."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from tests.helpers.kvstore import engine_prompts as prompts
from tests.helpers.kvstore import settled
from tests.helpers.subprocess import run_as_script

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BASE = dict(dtype="float32", max_num_batched_tokens=64, max_model_len=512)
CHILD = Path(__file__).resolve().parents[2] / "helpers" / "kvstore_engine.py"


def run(llm: LLM) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def store_messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("pagedserve.engine.kvstore") and text in r.getMessage()]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    with LLM(tiny, **BASE) as llm:
        return run(llm)[0]


def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) * 3 // 4] ^= 0x40  # a payload byte
        path.write_bytes(data)
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
def test_block_files_damaged_between_runs(tiny, reference, tmp_path, caplog, how):
    kw = {**BASE, "kv_store_dir": str(tmp_path), "kv_store_gb": 0.1}
    with LLM(tiny, **kw) as llm:
        assert run(llm)[0] == reference
    files = block_files(tmp_path)  # the pool's blocks, written at shutdown
    assert len(files) >= 5
    for path in files:
        _damage(path, how)
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.kvstore"):
        with LLM(tiny, **kw) as llm:
            tokens, cached = run(llm)
            assert tokens == reference
            assert cached[1:] == [32, 32, 0]  # the first request's blocks, computed again
            stats = llm.engine.kv_store_stats()
            assert stats["tier_placed"] == 0 and stats["disk_loads"] == 0
            assert stats["store_errors"] == 0 and stats["disk_errors"] == 0
            settled(llm)
    skipped = store_messages(caplog, "skipped block file")
    if how == "delete":  # a vanished file is a plain miss: nothing to say
        assert skipped == [] and stats["disk_skips"] == 0
    else:
        reason = "truncated" if how == "truncate" else "corrupt"
        assert stats["disk_skips"] >= 1 and len(skipped) == stats["disk_skips"]
        assert all(f"({reason})" in m for m in skipped), skipped
    # The damaged files are gone; the blocks computed again are stored afresh.
    with LLM(tiny, **kw) as llm:
        tokens, cached = run(llm)
        assert tokens == reference and cached[0] == 32
        assert llm.engine.kv_store_stats()["disk_skips"] == 0
        settled(llm)


def test_a_disk_that_fails_every_write(tiny, reference, tmp_path, monkeypatch, caplog):
    """Disk full (ENOSPC on every new file under the store): one warning, the store off,
    the outputs unchanged."""
    real_open = os.open
    root = str(tmp_path)

    def full_disk(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and str(path).startswith(root):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", full_disk)
    kw = {**BASE, "kv_store_dir": root, "kv_store_gb": 0.1, "kv_store_write_through": True}
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.kvstore"):
        with LLM(tiny, **kw) as llm:
            assert run(llm)[0] == reference
            llm.engine.kv_store.store.flush()
            stats = llm.engine.kv_store_stats()
            assert stats["disk_enabled"] == 0 and stats["disk_errors"] == 1
            assert llm.reset_prefix_cache()
            tokens, cached = run(llm)
            assert tokens == reference and cached == [0, 32, 32, 0]  # computed again
            stats = llm.engine.kv_store_stats()
            assert stats["tier_hits"] == 0 and stats["disk_writes"] == 0
            settled(llm)
    assert len(store_messages(caplog, "No space left")) == 1
    assert block_files(tmp_path) == [] and list(tmp_path.rglob(".tmp-*")) == []


def test_a_process_killed_while_its_store_writes(tiny, reference, tmp_path):
    proc = subprocess.Popen(run_as_script(CHILD, tiny, str(tmp_path)),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "READY"
        before = len(block_files(tmp_path))
        deadline = time.monotonic() + 60
        while len(block_files(tmp_path)) < before + 8:  # its writer is under way
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(block_files(tmp_path)) >= before + 8
    with LLM(tiny, **BASE, kv_store_dir=str(tmp_path), kv_store_gb=0.5) as llm:
        assert list(tmp_path.rglob(".tmp-*")) == []  # a dead writer's partial files go
        tokens, cached = run(llm)
        assert tokens == reference and all(c >= 32 for c in cached[:3])
        stats = llm.engine.kv_store_stats()
        assert stats["disk_loads"] >= 2 and stats["disk_skips"] == 0
        settled(llm)
