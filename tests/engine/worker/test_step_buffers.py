"""The step's inputs staged in reused buffers, and block tables updated incrementally."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.step_buffers import ALIGN, BlockTableRows, StagingBuffer, layout


def test_staging_reuses_its_buffers_and_aligns_every_array() -> None:
    buf = StagingBuffer("cpu", capacity=256)
    host, dev = buf.host.data_ptr(), buf.dev.data_ptr()
    assert not buf.pinned  # pinned only for a GPU
    ptrs = None
    for step in range(3):
        ids, qsl, empty = buf.stage([([step, 7, 9], torch.int64), ([0, 1, 3 + step], torch.int32),
                                     ([], torch.int64)])  # fmt: skip
        assert ids.tolist() == [step, 7, 9] and ids.dtype == torch.int64
        assert qsl.tolist() == [0, 1, 3 + step] and qsl.dtype == torch.int32
        assert empty.numel() == 0
        assert all(t.data_ptr() % ALIGN == 0 for t in (ids, qsl))
        now = [t.data_ptr() for t in (ids, qsl)]
        assert ptrs is None or now == ptrs  # same views every step: same kernel variants
        ptrs = now
    assert (buf.host.data_ptr(), buf.dev.data_ptr()) == (host, dev)
    (big,) = buf.stage([(list(range(100)), torch.int64)])  # grows once, keeps working
    assert big.tolist() == list(range(100)) and buf.capacity >= 800


def test_block_rows_write_only_new_entries_and_reuse_released_rows() -> None:
    rows = BlockTableRows(4, "cpu", num_rows=1)
    row_a, idx, vals = rows.changes("a", [5, 6])
    assert (idx, vals) == ([row_a * 4, row_a * 4 + 1], [5, 6])
    rows.apply(torch.tensor(idx), torch.tensor(vals, dtype=torch.int32))
    assert rows.changes("a", [5, 6, 9])[1:] == ([row_a * 4 + 2], [9])
    rows.apply(torch.tensor([row_a * 4 + 2]), torch.tensor([9], dtype=torch.int32))
    row_b, idx, _ = rows.changes("b", [1])  # a second row: the table grows
    assert row_b != row_a and idx == [row_b * 4]
    assert rows.changes("a", [5, 6, 9]) == (row_a, [], [])
    rows.release("a")
    assert rows.changes("c", [3])[0] == row_a  # a released row is reused
    with pytest.raises(ValueError, match="ensure_width"):
        rows.changes("c", [1, 2, 3, 4, 5])
    rows.ensure_width(5)
    assert rows.width >= 5 and rows.table[row_a, :3].tolist() == [5, 6, 9]


def test_incremental_block_tables_equal_a_full_rebuild(tmp_path) -> None:
    """A workload with prefix hits and preemptions: every step's block table (the gather
    of incrementally updated rows) holds each request's whole table, as a table built
    from scratch does, and the greedy tokens match an engine with room for all."""
    from pagedserve import LLM, SamplingParams
    from tests.helpers.models import write_tiny_model

    model = str(write_tiny_model(tmp_path / "tiny"))
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(100, 40000, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(100, 40000, (5 + 7 * i,), generator=gen).tolist()
               for i in range(6)]  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)

    def run(**kw):
        llm = LLM(model=model, dtype="float32", attention_backend="torch", block_size=16,
                  max_num_batched_tokens=64, enable_prefix_caching=True, **kw)  # fmt: skip
        runner = llm.engine.worker.runner
        checked, wrong = [0], []
        prepare = runner.prepare

        def checked_prepare(sched):
            step = prepare(sched)
            order = [r for r, n in sched.num_scheduled_tokens.items() if n == 1]
            order += [r for r, n in sched.num_scheduled_tokens.items() if n != 1]
            table = step.meta.block_tables.cpu()
            for i, rid in enumerate(order):
                ids = runner.requests[rid].block_ids
                if table[i, : len(ids)].tolist() != ids:  # (an assert here fails the step)
                    wrong.append((checked[0], rid, ids, table[i, : len(ids)].tolist()))
            checked[0] += 1
            return step

        runner.prepare = checked_prepare
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert wrong == [], wrong[:3]
        return llm, [o.outputs[0].token_ids for o in outs], checked[0]

    small, tokens, steps = run(num_gpu_blocks_override=14)
    assert small.engine.scheduler.num_preemptions > 0 and steps > 24
    assert small.engine.kv.num_prefix_cache_hits > 0
    assert small.engine.kv.stats().num_free_blocks == 14
    _, ref, _ = run()
    assert tokens == ref


def test_staging_into_a_destination_uses_the_layout_offsets() -> None:
    buf = StagingBuffer("cpu", capacity=64)
    _, total = layout([3 * 8, 2 * 4])
    dest = torch.zeros(total + 16, dtype=torch.uint8)
    a, b = buf.stage([([1, 2, 3], torch.int64), ([4, 5], torch.int32)], into=dest)
    assert a.tolist() == [1, 2, 3] and b.tolist() == [4, 5]
    offsets, _ = layout([3 * 8, 2 * 4])
    assert [t.data_ptr() - dest.data_ptr() for t in (a, b)] == offsets
    assert buf.num_copies == 1 and buf.num_stages == 1
    with pytest.raises(ValueError, match="do not fit"):
        buf.stage([(list(range(8)), torch.int64)], into=torch.zeros(32, dtype=torch.uint8))
