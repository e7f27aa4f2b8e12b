"""A server with a KV block store: its counters in ``/metrics``, and store hits counted in
the usage's ``cached_tokens``."""

from __future__ import annotations

import base64
import time

import pytest
import requests

from tests.helpers.server import ServerProcess, metric_value


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    store = tmp_path_factory.mktemp("kvstore")
    args = ["--model", str(tiny_model_factory("llama")), "--dtype", "float32",
            "--num-gpu-blocks-override", "8", "--max-model-len", "128",
            "--kv-host-gb", "0.01", "--kv-store-dir", str(store), "--kv-store-gb", "0.05",
            "--log-level", "warning"]  # fmt: skip
    with ServerProcess(args) as srv:
        yield srv


def _complete(srv: ServerProcess, prompt: list[int]) -> dict:
    model = requests.get(srv.url + "/v1/models").json()["data"][0]["id"]
    r = requests.post(srv.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_store_hits_are_cached_tokens_and_counted_in_metrics(server):
    models = requests.get(server.url + "/v1/models").json()["data"]
    prompt = [(i * 37) % 4000 + 5 for i in range(40)]
    other = [(i * 11) % 3000 + 7 for i in range(110)]
    first = _complete(server, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _complete(server, other)  # takes the whole pool: the prompt's blocks go to the store
    again = _complete(server, prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    model = models[0]["id"]
    # The store writes on its own thread, and the engine reads its counters again within
    # half a second: wait for the writes to show.
    deadline = time.monotonic() + 10
    while True:
        text = requests.get(server.url + "/metrics").text
        written = metric_value(text, "pagedserve:kv_store_writes_total", model_name=model,
                               tier="memory")  # fmt: skip
        if written and written >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert metric_value(text, "pagedserve:kv_store_saved_blocks_total", model_name=model) >= 2
    assert metric_value(text, "pagedserve:kv_store_hits_total", model_name=model) == 2
    assert metric_value(text, "pagedserve:kv_store_loaded_blocks_total", model_name=model) == 2
    assert metric_value(text, "pagedserve:kv_store_writes_total", model_name=model,
                        tier="memory") >= 2
    assert metric_value(text, "pagedserve:kv_store_bytes_used", model_name=model,
                        tier="memory") > 0
    assert metric_value(text, "pagedserve:prefix_cache_hits_total", model_name=model) >= 32
    # The block map marks the two blocks read back, free and cached now.
    state = requests.get(server.url + "/v1/kv_cache/state").json()
    cells = base64.b64decode(state["cells"])
    loaded = base64.b64decode(state["loaded_cells"])
    assert len(loaded) == len(cells) == 8 and loaded.count(1) == 2
    assert all(cells[i] == 1 for i in range(8) if loaded[i])
    assert state["counters"]["num_loaded_blocks"] == 2
