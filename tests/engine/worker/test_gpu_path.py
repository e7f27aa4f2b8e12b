"""The device-independent parts of the CUDA path's decode graphs, on the CPU: the batch
ladder and padding (:mod:`pagedserve.engine.worker.cuda_graphs`, run eagerly on static buffers with the
torch backend); its KV-cache budget is in ``test_gpu_memory.py``. Neither imports Triton.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from pagedserve.engine.worker import cuda_graphs
from pagedserve.engine.worker.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeBuffers,
    DecodeGraphRunner,
    capture_sizes,
    graphs_wanted,
    max_blocks_per_seq,
    padded_batch_size,
)
from pagedserve.engine.worker.model_runner import StepInputs
from pagedserve.kernels import AttentionMetadata, get_attention_backend
from tests.helpers.models import tiny_decoder

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
    model, bs, nb = tiny_decoder(), 16, 24
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
    model, bs, nb = tiny_decoder(), 16, 40
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
    from pagedserve import LLM, SamplingParams
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
                               w.settings.max_model_len, capture_sizes(4), w.settings.device,
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


# -- imports ----------------------------------------------------------------------------


def test_cpu_path_imports_no_triton() -> None:
    assert "pagedserve.engine.worker.cuda_graphs" in sys.modules
    import subprocess

    code = ("import sys, pagedserve.engine.worker.cuda_graphs, pagedserve.engine.worker.gpu_memory, "
            "pagedserve.engine.worker.worker, pagedserve.engine.worker.model_runner; "
            "assert 'triton' not in sys.modules, 'triton imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
