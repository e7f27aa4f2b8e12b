"""The default model's server that ``test_api.py`` and ``test_api_logprobs.py`` share: one
subprocess for this folder, stopped after its tests."""

from __future__ import annotations

import pytest

from tests.helpers.server import ServerProcess

API_SERVER_ARGS = ["--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
                   "--max-model-len", "2048", "--dtype", "float32", "--log-level", "warning"]


@pytest.fixture(scope="package")
def api_server(default_model_path):
    with ServerProcess(API_SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="package")
def api_client(api_server):
    return api_server.openai_client()


@pytest.fixture(scope="package")
def api_aclient_factory(api_server):
    return lambda: api_server.openai_client(asynchronous=True)
