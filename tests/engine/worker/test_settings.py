"""Engine settings are resolved once, before the worker exists, and every part reads them."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, EngineConfig
from pagedserve.engine.worker.settings import resolve_settings


def test_settings_resolve_the_autos_against_the_model(default_model_path) -> None:
    s = resolve_settings(EngineConfig(model=str(default_model_path), dtype="float32",
                                      device="cpu"))  # fmt: skip
    assert s.model_path == default_model_path and s.device == torch.device("cpu")
    assert s.dtype == torch.float32 and s.quantization is None
    assert s.max_model_len == s.hf_config.max_position_embeddings  # the model's own
    assert s.max_num_batched_tokens == 2048  # chunked prefill's default budget
    assert s.vocab_size == s.decoder.vocab_size == s.hf_config.vocab_size
    unchunked = resolve_settings(EngineConfig(model=str(default_model_path), device="cpu",
                                              max_model_len=4096, enable_chunked_prefill=False))
    assert unchunked.max_num_batched_tokens == 4096  # room for a whole prompt
    with pytest.raises(ValueError, match=r"max_model_len=1000000 is larger than the model's"):
        resolve_settings(EngineConfig(model=str(default_model_path), max_model_len=1_000_000))


def test_every_part_reads_the_one_resolved_settings(default_model_path) -> None:
    llm = LLM(str(default_model_path), dtype="float32", max_model_len=700,
              kv_cache_memory_gb=0.05)  # fmt: skip
    eng = llm.engine
    s = eng.settings
    assert eng.worker.settings is s  # the worker was built from them, not the config
    assert (s.max_model_len, s.dtype) == (700, torch.float32)
    assert eng.scheduler.max_model_len == eng.limits.max_model_len == s.max_model_len
    assert eng.scheduler.max_num_batched_tokens == s.max_num_batched_tokens
    assert eng.limits.vocab_size == s.vocab_size
    # The worker keeps no second copy of a resolved setting.
    for name in ("max_model_len", "max_num_batched_tokens", "dtype", "device", "model_path",
                 "hf_config", "quantization", "vocab_size"):
        assert not hasattr(eng.worker, name), name
    # The one number the worker reports: the KV blocks its memory holds.
    assert eng.kv.num_blocks == eng.worker.num_blocks == eng.limits.num_kv_blocks
