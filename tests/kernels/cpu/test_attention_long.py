"""The native CPU attention kernel at long contexts: decode contexts split among threads
(parts of 512 rows, merged), long prefill chunks through the tiled path, and batches
mixing them with short requests, against the torch reference at every build level."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.synthetic import make_step
from tests.helpers.kernels import NATIVE_TOL as TOL
from tests.helpers.kernels import decodes_as_chunks


@pytest.fixture
def lib(native_lib):
    return native_lib


def step_of(seq_lens, q_lens, heads, head_dim, block_size, dtype, seed=0):
    step = make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)  # fmt: skip
    write_kv(step.key, step.value, step.k_cache, step.v_cache, step.meta.slot_mapping)
    return step


def attend(lib, step, chunks: bool = True) -> torch.Tensor:
    m = step.meta
    return cpu_native.paged_attention(
        lib, step.query, step.k_cache, step.v_cache, m.block_tables, m.seq_lens,
        max(m.seq_lens_cpu), step.scale, query_start_loc=m.query_start_loc if chunks else None,
    )  # fmt: skip


def prefill_reference(step) -> torch.Tensor:
    m = step.meta
    return paged_prefill_attention(step.query, step.k_cache, step.v_cache, m.block_tables,
                                   m.query_start_loc, m.seq_lens, step.scale)  # fmt: skip


# Contexts around the 512-row parts (one, two, many), up to 16k; a 48-row block does
# not divide 512, so parts are rounded to whole blocks; a 128-row block (the largest the
# engine takes) holds 16 runs of AVX2's 8 rows, all of whose scores a block keeps.
DECODE_LENS = [1, 7, 511, 512, 513, 1025, 1500, 4097, 16384]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 48, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
def test_long_decodes_match_reference(lib, heads, block_size, dtype) -> None:
    step = step_of(DECODE_LENS, [1] * len(DECODE_LENS), heads, 64, block_size, dtype)
    m = step.meta
    out = attend(lib, step, chunks=False)
    want = paged_decode_attention(step.query, step.k_cache, step.v_cache, m.block_tables,
                                  m.seq_lens, step.scale)  # fmt: skip
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])


# (seq_lens, q_lens): a chunk at the end of a 16k context, whole prompts on both sides
# of the tiled path's 32 tokens, and a batch mixing long and short decodes with chunks.
CHUNKS = [
    ([16384], [64]),
    ([700], [700]),
    ([31, 32, 33], [31, 32, 33]),
    ([3000, 5, 9000, 40, 600], [1, 5, 1, 40, 77]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 48, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (16, 2)])
@pytest.mark.parametrize("case", CHUNKS)
def test_long_chunks_match_reference(lib, case, heads, block_size, dtype) -> None:
    step = step_of(*case, heads, 64, block_size, dtype)
    out = attend(lib, step)
    n = int(step.meta.query_start_loc[-1])
    torch.testing.assert_close(out[:n].float(), prefill_reference(step)[:n].float(), **TOL[dtype])


@pytest.mark.parametrize("head_dim", [128, 96, 40])
def test_tiled_chunks_at_other_head_dims(lib, head_dim) -> None:
    step = step_of([900, 2], [300, 2], (6, 2), head_dim, 16, torch.float32)
    out = attend(lib, step)
    torch.testing.assert_close(out, prefill_reference(step), **TOL[torch.float32])


def test_split_context_results_do_not_depend_on_batching(lib) -> None:
    """A decode of a split context has the same bits as that position inside a short
    chunk (as speculative verification attends it) and whatever its step holds."""
    heads = (9, 3)
    lens = [1500, 2100]
    decode = step_of(lens, [1, 1], heads, 64, 16, torch.float32)
    alone = attend(lib, decode, chunks=False)
    # The same caches and queries as a chunk of 3 tokens per request: token 2 of each is
    # the decode above.
    m = decode.meta
    query, qsl = decodes_as_chunks(decode)
    chunk = cpu_native.paged_attention(lib, query, decode.k_cache, decode.v_cache,
                                       m.block_tables, m.seq_lens, max(lens), decode.scale,
                                       query_start_loc=qsl)  # fmt: skip
    assert torch.equal(chunk[2], alone[0]) and torch.equal(chunk[5], alone[1])
    # On one thread or many, with short neighbours.
    mixed = step_of(lens + [5, 40], [1, 1, 1, 1], heads, 64, 16, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(lib, mixed, chunks=False)
        torch.set_num_threads(max(2, threads))
        many = attend(lib, mixed, chunks=False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
