"""The device-independent parts of the CUDA path, on the CPU: the decode-graph batch
ladder and padding (:mod:`engine.cuda_graphs`, run eagerly on static buffers with the
torch backend) and the KV-budget arithmetic and profiling step (:mod:`engine.gpu_memory`).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from engine import cuda_graphs
from engine.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeBuffers,
    DecodeGraphRunner,
    capture_sizes,
    graphs_wanted,
    max_blocks_per_seq,
    padded_batch_size,
)
from engine.gpu_memory import (
    GiB,
    KVBudgetError,
    MemoryProfile,
    build_dummy_step,
    dummy_kv_caches,
    dummy_step_layout,
    kv_cache_blocks,
    kv_cache_budget,
    run_dummy_step,
)
from engine.model_runner import StepInputs
from engine.models.decoder import DecoderForCausalLM, DecoderSpec
from kernels import AttentionMetadata, get_attention_backend

# -- the batch-size ladder ---------------------------------------------------------------


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160,
                                  176, 192, 208, 224, 240, 256]  # fmt: skip
    assert capture_sizes(128)[-1] == 128
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    assert capture_sizes(10_000) == capture_sizes(MAX_CAPTURE_SIZE)
    assert capture_sizes(300, cap=40) == [1, 2, 4, 8, 16, 24, 32, 40]
    for n in range(1, 300):
        sizes = capture_sizes(n)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1
        assert sizes[-1] == min(n, MAX_CAPTURE_SIZE)
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_batch_size() -> None:
    sizes = capture_sizes(100)
    assert padded_batch_size(0, sizes) is None
    assert padded_batch_size(1, sizes) == 1
    assert padded_batch_size(3, sizes) == 4
    assert padded_batch_size(9, sizes) == 16
    assert padded_batch_size(33, sizes) == 48
    assert padded_batch_size(97, sizes) == 100
    assert padded_batch_size(101, sizes) is None
    for n in range(1, 101):
        p = padded_batch_size(n, sizes)
        assert p is not None and p >= n and p in sizes
        assert all(s < n for s in sizes if s < p)  # the smallest that fits
        assert p < 2 * n  # less than half of a padded batch is padding


def test_max_blocks_per_seq_and_graphs_wanted() -> None:
    assert max_blocks_per_seq(1024, 16) == 64
    assert max_blocks_per_seq(1025, 16) == 65
    assert max_blocks_per_seq(1, 128) == 1
    triton_like = SimpleNamespace(name="triton")
    torch_like = SimpleNamespace(name="torch")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_wanted(cuda, False, triton_like)
    assert not graphs_wanted(cuda, True, triton_like)  # enforce_eager
    assert not graphs_wanted(cuda, False, torch_like)  # not graph-safe
    assert not graphs_wanted(cpu, False, triton_like)


# -- static buffers and padding ----------------------------------------------------------


def test_decode_buffers_load_and_pad() -> None:
    bufs = DecodeBuffers.allocate(8, max_blocks=6, device="cpu")
    assert bufs.slot_mapping.tolist() == [-1] * 8 and bufs.seq_lens.tolist() == [1] * 8
    assert bufs.query_start_loc.tolist() == list(range(9))
    # A first step of 5 rows with a block table 3 wide.
    bt = torch.arange(1, 16, dtype=torch.int32).view(5, 3)
    bufs.load(torch.arange(10, 15), torch.arange(20, 25), torch.arange(30, 35),
              torch.arange(40, 45, dtype=torch.int32), bt, padded=8)  # fmt: skip
    assert bufs.input_ids.tolist() == [10, 11, 12, 13, 14, 0, 0, 0]
    assert bufs.positions.tolist() == [20, 21, 22, 23, 24, 0, 0, 0]
    assert bufs.slot_mapping.tolist() == [30, 31, 32, 33, 34, -1, -1, -1]
    assert bufs.seq_lens.tolist() == [40, 41, 42, 43, 44, 1, 1, 1]
    assert torch.equal(bufs.block_tables[:5, :3], bt)
    assert bufs.block_tables[5:, 0].tolist() == [0, 0, 0]
    # A smaller step padded to 4: rows 2-3 become padding although step 1 filled them;
    # rows past the padded size are not touched (no graph of this size reads them).
    bufs.load(torch.tensor([7, 8]), torch.tensor([3, 4]), torch.tensor([50, 51]),
              torch.tensor([4, 5], dtype=torch.int32),
              torch.tensor([[9], [11]], dtype=torch.int32), padded=4)  # fmt: skip
    assert bufs.input_ids[:4].tolist() == [7, 8, 0, 0]
    assert bufs.slot_mapping[:4].tolist() == [50, 51, -1, -1]
    assert bufs.seq_lens[:4].tolist() == [4, 5, 1, 1]
    assert bufs.block_tables[:4, 0].tolist() == [9, 11, 0, 0]
    # Stale columns are valid block ids from earlier steps, beyond every row's length.
    assert bufs.block_tables[:2, 1:3].tolist() == [[2, 3], [5, 6]]
    with pytest.raises(ValueError):
        bufs.load(torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64),
                  torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.int32),
                  torch.zeros(5, 1, dtype=torch.int32), padded=4)  # fmt: skip
    # A block table wider than the buffers (blocks allocated ahead) is cut.
    bufs.load(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]),
              torch.tensor([1], dtype=torch.int32),
              torch.arange(8, dtype=torch.int32).view(1, 8), padded=1)  # fmt: skip
    assert bufs.block_tables[0].tolist() == list(range(6))


def test_decode_buffers_metadata() -> None:
    bufs = DecodeBuffers.allocate(8, max_blocks=4, device="cpu")
    meta = bufs.metadata(4, max_model_len=64)
    assert meta.num_decodes == meta.num_reqs == 4 and meta.max_query_len == 1
    assert meta.seq_lens_cpu == [64] * 4 and meta.max_seq_len == 64
    assert meta.query_start_loc_cpu == [0, 1, 2, 3, 4]
    assert meta.block_tables.shape == (4, 4)
    assert meta.slot_mapping.data_ptr() == bufs.slot_mapping.data_ptr()  # views
    meta = bufs.metadata(2, max_model_len=64, seq_lens_cpu=[5, 1])
    assert meta.seq_lens_cpu == [5, 1] and meta.max_seq_len == 5


# -- the padded decode path against the plain forward pass (torch backend) ---------------


def _tiny_model(max_model_len: int = 128) -> DecoderForCausalLM:
    spec = DecoderSpec(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False,
        mlp_bias=False, qk_norm=False, tie_word_embeddings=False,
        max_position_embeddings=max_model_len,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderForCausalLM(spec).eval()
    model.set_rope(SimpleNamespace(rope_theta=10000.0), max_model_len)
    return model


def _decode_step(seq_lens: list[int], block_size: int, num_blocks: int) -> StepInputs:
    """A decode-only step over disjoint, shuffled block tables."""
    gen = torch.Generator().manual_seed(1)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for s in seq_lens:
        nb = -(-s // block_size)
        tables.append(perm[:nb])
        perm = perm[nb:]
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    pos = [s - 1 for s in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, pos, strict=True)]
    n = len(seq_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt, num_decodes=n, max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=list(seq_lens),
    )  # fmt: skip
    ids = torch.randint(0, 97, (n,), generator=gen)
    return StepInputs(ids, torch.tensor(pos), meta, torch.arange(n), [])


def _random_caches(model, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, ...]]:
    s = model.spec
    gen = torch.Generator().manual_seed(2)
    shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in range(s.num_layers)]  # fmt: skip


@pytest.mark.parametrize("seq_lens", [[1], [5, 17, 33], [40, 1, 9, 16, 64, 3]])
def test_padded_decode_runner_matches_plain_forward(seq_lens) -> None:
    model, bs, nb = _tiny_model(), 16, 24
    attn = get_attention_backend("torch", "cpu")
    step = _decode_step(seq_lens, bs, nb)
    ref_caches = _random_caches(model, nb, bs)
    caches = [(k.clone(), v.clone()) for k, v in ref_caches]
    with torch.inference_mode():
        attn.prepare(step.meta, bs)
        ref = model(step.input_ids, step.positions, ref_caches, step.meta, attn)
        runner = DecodeGraphRunner(model, attn, caches, bs, 128, capture_sizes(8),
                                   torch.device("cpu"), use_graphs=False)  # fmt: skip
        out = runner.run(step)
    assert out is not None and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Same KV writes: padding rows (slot -1) wrote nothing.
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    assert runner.num_replays == 1


def test_decode_runner_declines_what_it_cannot_run() -> None:
    model, bs, nb = _tiny_model(), 16, 40
    attn = get_attention_backend("torch", "cpu")
    caches = _random_caches(model, nb, bs)
    runner = DecodeGraphRunner(model, attn, caches, bs, 128, capture_sizes(4),
                               torch.device("cpu"), use_graphs=False)  # fmt: skip
    assert runner.run(_decode_step([3] * 5, bs, nb)) is None  # more rows than the ladder
    mixed = _decode_step([3, 9], bs, nb)
    mixed.meta.num_decodes = 1  # a prefill among them
    assert runner.run(mixed) is None
    assert runner.num_eager_fallbacks == 2 and runner.num_replays == 0
    with pytest.raises(ValueError):
        DecodeGraphRunner(model, attn, caches, bs, 128, [4, 2], torch.device("cpu"))


@pytest.mark.parametrize("tail_bytes", [cuda_graphs.TAIL_BYTES, 16])
def test_model_runner_uses_decode_runner(tmp_path, monkeypatch, tail_bytes) -> None:
    """The runner hook: decode-only steps go through the padded runner, and the greedy
    tokens are those of the plain eager engine. Each such step is staged straight into
    the runner's static buffers in one copy, unless its arrays do not fit there (a tail
    of 16 bytes): then it is staged as usual and copied in."""
    from engine import LLM, SamplingParams
    from tests.helpers.models import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny")
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (7, 21, 30)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    llm = LLM(model=str(path), max_num_batched_tokens=16, enable_prefix_caching=False,
              max_num_seqs=4, device="cpu", attention_backend="torch")  # fmt: skip
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    w = llm.engine.worker
    assert w.runner.decode_graphs is None  # CPU: eager
    monkeypatch.setattr(cuda_graphs, "TAIL_BYTES", tail_bytes)
    runner = DecodeGraphRunner(w.model, w.attn, w.runner.kv_caches, w.config.block_size,
                               w.max_model_len, capture_sizes(4), w.device,
                               use_graphs=False)  # fmt: skip
    w.runner.decode_graphs = runner
    staged = []
    prepare = w.runner.prepare

    def spy(sched):
        before = w.runner.staging.num_copies
        step = prepare(sched)
        staged.append((step, w.runner.staging.num_copies - before))
        return step

    monkeypatch.setattr(w.runner, "prepare", spy)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert out == ref
    assert runner.num_replays >= 5 and runner.num_eager_fallbacks > 0
    # One copy into the graph buffers; none for a step staged on the CPU (its host buffer
    # is the device buffer).
    assert all(copies == (step.graph_batch is not None) for step, copies in staged)
    packed = runner.buffers.packed
    lo, hi = packed.data_ptr(), packed.data_ptr() + packed.numel()
    into = [s for s, _ in staged if s.graph_batch is not None]
    if tail_bytes == 16:
        assert not into and runner.num_loads == runner.num_replays
        return
    assert len(into) == runner.num_replays and runner.num_loads == 0
    for step in into:
        for t in (step.input_ids, step.positions, step.meta.slot_mapping, step.meta.seq_lens,
                  step.logits_indices):
            assert lo <= t.data_ptr() < hi


# -- the KV budget -----------------------------------------------------------------------


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
    from engine import gpu_memory

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
    model = _tiny_model(max_model_len=128)
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


def test_cpu_path_imports_no_triton() -> None:
    assert "engine.cuda_graphs" in sys.modules and "engine.gpu_memory" in sys.modules
    import subprocess

    code = ("import sys, engine.cuda_graphs, engine.gpu_memory, engine.worker, "
            "engine.model_runner; assert 'triton' not in sys.modules, 'triton imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
