"""``pagedserve serve --tensor-parallel-size 2``: the server's streaming, disconnect and
429 checks on a tensor-parallel engine, and a rank killed mid-run turning the server to
503s and an exit that leaves no process behind.

The default model's 9 heads do not split two ways, so these run a tiny random Llama with
the default model's tokenizer and chat template, served under the default model's name.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import requests

from tests.helpers.server import ServerProcess, child_pids, process_alive
from tests.helpers.server_checks import (
    CHAT_PATH,
    MODEL,
    chat_stream_equals_whole,
    queue_full_gives_429,
    stream_disconnect_frees_blocks,
)

MSG = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def tiny_path(make_tiny, default_model_path, tmp_path_factory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("tp-llama"), default_model_path,
                     max_position_embeddings=2048)  # fmt: skip


def args(path: Path, *extra: str) -> list[str]:
    return [str(path), "--tensor-parallel-size", "2", "--served-model-name", MODEL,
            "--dtype", "float32", "--kv-cache-memory-gb", "0.25", "--log-level", "warning",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_path):
    with ServerProcess(args(tiny_path, "--max-num-seqs", "1", "--max-waiting-requests",
                            "1")) as srv:  # fmt: skip
        yield srv


def test_stream_equals_whole(server, default_tokenizer):
    client = server.openai_client()
    chat_stream_equals_whole(client, default_tokenizer, MSG)


def test_disconnect_frees_blocks(server):
    stream_disconnect_frees_blocks(server.url, MSG)


def test_429_when_waiting_queue_full(server):
    queue_full_gives_429(server.url, MSG)


def test_killed_rank_gives_503_and_leaves_nothing(tiny_path):
    shm_before = set(os.listdir("/dev/shm"))
    srv = ServerProcess(args(tiny_path)).start()
    try:
        ranks = child_pids(srv.pid)
        assert len(ranks) == 1, ranks
        body = {"model": MODEL, "messages": MSG, "max_tokens": 1500, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with requests.post(srv.url + CHAT_PATH, json=body, stream=True) as r:
            lines = r.iter_lines()
            next(line for line in lines if b'"content":"' in line)
            os.kill(ranks[0], signal.SIGKILL)
            t0 = time.monotonic()
            tail = b"\n".join(lines)  # the stream ends with an error event
        assert b'"error"' in tail and tail.rstrip().endswith(b"data: [DONE]")
        status = None
        while time.monotonic() - t0 < 5:
            try:
                status = requests.post(srv.url + CHAT_PATH, timeout=2, json={
                    "model": MODEL, "messages": MSG, "max_tokens": 2}).status_code
            except requests.ConnectionError:  # already exited
                status = "exited"
            if status in (503, "exited"):
                break
            time.sleep(0.1)
        assert status in (503, "exited"), status
        assert time.monotonic() - t0 < 5
        assert srv.wait(30) == 1  # exits for its supervisor to restart it
    finally:
        srv.kill()
    assert not any(process_alive(p) for p in ranks)
    assert set(os.listdir("/dev/shm")) <= shm_before
