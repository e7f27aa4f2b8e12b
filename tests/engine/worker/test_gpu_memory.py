"""The KV-cache budget of the CUDA path and its profiling step (:mod:`pagedserve.engine.worker.gpu_memory`),
device-independent parts run on the CPU: the budget arithmetic and its errors, the
worst-case step's layout and slots, and the profiling step through the torch backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.engine.errors import KVBudgetError
from pagedserve.engine.worker.gpu_memory import (
    GiB,
    MemoryProfile,
    build_dummy_step,
    dummy_kv_caches,
    dummy_step_layout,
    kv_cache_blocks,
    kv_cache_budget,
    run_dummy_step,
)
from pagedserve.kernels import get_attention_backend
from tests.helpers.models import tiny_decoder


def test_kv_cache_budget_arithmetic() -> None:
    total = 80 * GiB
    budget = kv_cache_budget(total, 0.9, weights=16 * GiB, activation_peak=2 * GiB,
                             non_torch=GiB, graph_reserve=GiB // 2)  # fmt: skip
    assert budget == pytest.approx(72 * GiB - 16 * GiB - 2 * GiB - GiB - GiB / 2)
    assert kv_cache_budget(total, 1.0, 0, 0, 0) == total
    prof = MemoryProfile(total=total, utilization=0.9, weights=16 * GiB,
                         activation_peak=2 * GiB, graph_reserve=GiB // 2, non_torch=GiB)  # fmt: skip
    assert prof.kv_budget == budget
    with_loras = MemoryProfile(total=total, utilization=0.9, weights=16 * GiB,
                               activation_peak=2 * GiB, graph_reserve=GiB // 2,
                               non_torch=GiB, lora_reserve=3 * GiB)  # fmt: skip
    assert with_loras.kv_budget == budget - 3 * GiB
    with pytest.raises(KVBudgetError, match="LoRA adapters 10.00 GiB"):
        kv_cache_budget(10 * GiB, 1.0, 0, 0, 0, lora_reserve=10 * GiB)
    assert kv_cache_blocks(budget, 2**20) == int(budget // 2**20)
    assert kv_cache_blocks(2**20 - 1, 2**20) == 0
    with pytest.raises(ValueError):
        kv_cache_blocks(GiB, 0)


def test_kv_cache_budget_negative_is_a_clear_error() -> None:
    with pytest.raises(KVBudgetError) as err:
        kv_cache_budget(24 * GiB, 0.9, weights=16 * GiB, activation_peak=5 * GiB,
                        non_torch=GiB, graph_reserve=0)  # fmt: skip
    msg = str(err.value)
    assert "no GPU memory is left for the KV cache" in msg
    assert "21.60 GiB allowed" in msg and "weights take 16.00 GiB" in msg
    assert "activation peak" in msg and "5.00 GiB" in msg
    assert "gpu_memory_utilization" in msg and "max_num_batched_tokens" in msg
    assert isinstance(err.value, ValueError)
    with pytest.raises(KVBudgetError):  # exactly zero is no budget either
        kv_cache_budget(10 * GiB, 0.5, 5 * GiB, 0, 0)
    with pytest.raises(ValueError):
        kv_cache_budget(10 * GiB, 0.0, 0, 0, 0)
    with pytest.raises(ValueError):
        kv_cache_budget(10 * GiB, 0.9, -1, 0, 0)


def test_dummy_step_layout() -> None:
    assert dummy_step_layout(2048, 4096) == [(2048, 4096)]
    assert dummy_step_layout(2048, 1024) == [(1024, 1024), (1024, 1024)]
    assert dummy_step_layout(2500, 1024) == [(1024, 1024), (1024, 1024), (452, 1024)]
    assert dummy_step_layout(2049, 1024) == [(1, 1024), (1024, 1024), (1024, 1024)]
    for n, m in [(1, 1), (7, 3), (512, 100), (8192, 8192)]:
        layout = dummy_step_layout(n, m)
        assert sum(q for q, _ in layout) == n and all(1 <= q <= s == m for q, s in layout)
    with pytest.raises(ValueError):
        dummy_step_layout(0, 16)


def test_dummy_step_layout_includes_decode_rows() -> None:
    """The worst-case step has decodes at max_model_len beside its prefill (their split-KV
    scratch is part of the peak), always leaving a prefill chunk."""
    assert dummy_step_layout(2048, 4096, 3) == [(1, 4096)] * 3 + [(2045, 4096)]
    assert dummy_step_layout(16, 1024, 255) == [(1, 1024)] * 16
    assert dummy_step_layout(2049, 1024, 1) == [(1, 1024), (1024, 1024), (1024, 1024)]
    step = build_dummy_step(dummy_step_layout(40, 64, 5), 16, 4, "cpu")
    assert step.meta.num_decodes == 5 and step.meta.seq_lens_cpu == [64] * 6


def test_graph_reserve_counts_reserved_segments(monkeypatch) -> None:
    """The graph reserve is measured in reserved bytes (what the graphs' pool keeps), not
    in allocated ones."""
    from pagedserve.engine.worker import gpu_memory

    state = {"alloc": 0, "reserved": 0, "peak_alloc": 0, "peak_reserved": 0}

    def fake_step():
        state.update(peak_alloc=state["alloc"] + 3 * 2**20,
                     peak_reserved=state["reserved"] + 20 * 2**20)  # fmt: skip

    fake = SimpleNamespace(
        synchronize=lambda d: None, empty_cache=lambda: None,
        reset_peak_memory_stats=lambda d: None,
        memory_allocated=lambda d: state["alloc"], memory_reserved=lambda d: state["reserved"],
        max_memory_allocated=lambda d: state["peak_alloc"],
        max_memory_reserved=lambda d: state["peak_reserved"])  # fmt: skip
    monkeypatch.setattr(gpu_memory.torch, "cuda", fake)
    assert gpu_memory._peak_above_current(fake_step, "cuda") == 3 * 2**20
    assert gpu_memory._peak_above_current(fake_step, "cuda", reserved=True) == 20 * 2**20


def test_build_dummy_step_slots_follow_block_tables() -> None:
    layout = [(1, 50), (30, 70), (12, 12)]
    step = build_dummy_step(layout, block_size=16, num_cache_blocks=4, device="cpu")
    m = step.meta
    assert m.num_decodes == 1 and m.query_start_loc_cpu == [0, 1, 31, 43]
    assert m.seq_lens_cpu == [50, 70, 12] and m.max_query_len == 30
    assert int(m.block_tables.max()) < 4 and m.block_tables.shape == (3, 5)
    assert step.positions[:2].tolist() == [49, 40] and step.positions[-1].item() == 11
    qsl = m.query_start_loc_cpu
    for i in range(len(layout)):
        for t in range(qsl[i], qsl[i + 1]):
            p = int(step.positions[t])
            block = int(m.block_tables[i, p // 16])
            assert int(m.slot_mapping[t]) == block * 16 + p % 16
    with pytest.raises(ValueError):
        build_dummy_step([(4, 8), (1, 8)], 16, 4, "cpu")  # decodes must come first


def test_dummy_profiling_step_runs_with_the_sampler() -> None:
    """The profiling step on the CPU: a long chunk over a small shared cache, then the
    sampler with every costly option on ``max_num_seqs`` rows."""
    model = tiny_decoder(max_model_len=128)
    attn = get_attention_backend("torch", "cpu")
    s = model.spec
    caches = dummy_kv_caches(s.num_layers, 4, 16, s.num_kv_heads, s.head_dim, torch.float32,
                             "cpu")  # fmt: skip
    assert len({id(k) for k, _ in caches}) == 1  # one shared pair
    step = build_dummy_step(dummy_step_layout(200, 128), 16, 4, "cpu")
    hidden = run_dummy_step(model, attn, caches, step, 16, num_sample_rows=6, vocab_size=97)
    assert hidden.shape == (200, s.hidden_size) and torch.isfinite(hidden).all()
    decode = build_dummy_step([(1, 128)] * 5, 16, 4, "cpu")
    assert run_dummy_step(model, attn, caches, decode, 16).shape == (5, s.hidden_size)
