"""Torch reference, TorchBackend and CpuBackend against a naive dense-attention oracle."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.engine.worker.kernel_settings import kernel_settings
from pagedserve.kernels import (
    AttentionMetadata,
    KernelSettings,
    get_attention_backend,
    paged_decode_attention,
    paged_prefill_attention,
    select_kernels,
    write_kv,
)
from pagedserve.kernels.cpu.synthetic import PagedStep, make_step
from pagedserve.kernels.torch_backend import TorchBackend
from tests.helpers.kernels import fused_qkv_views

# Both CPU backends: pure torch, and torch with the native decode kernel.
CPU_BACKENDS = ["torch", "cpu"]

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# The backend computes in the input dtype (SDPA), the reference in float32.
BACKEND_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def naive_attention(step: PagedStep, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Per request: contiguous K/V from the block table, explicit causal softmax (over
    each query's last ``window`` positions when ``window`` > 0; scores capped at
    ``softcap`` by tanh when ``softcap`` > 0)."""
    meta, bs = step.meta, step.block_size
    q_all = step.query.double()
    num_heads, head_dim = q_all.shape[1:]
    num_kv_heads = step.k_cache.shape[2]
    out = torch.zeros_like(q_all)
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        table = meta.block_tables[i].tolist()
        k = torch.stack([step.k_cache[table[p // bs], p % bs] for p in range(seq_len)]).double()
        v = torch.stack([step.v_cache[table[p // bs], p % bs] for p in range(seq_len)]).double()
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        q = q_all[qsl[i] : qsl[i + 1]]  # [q_len, Hq, D]
        q_len = q.shape[0]
        scores = torch.einsum("qhd,lhd->hql", q, k) * step.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        causal = torch.arange(seq_len)[None, :] <= q_pos
        if window:
            causal &= torch.arange(seq_len)[None, :] > q_pos - window
        scores = scores.masked_fill(~causal, float("-inf"))
        out[qsl[i] : qsl[i + 1]] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    return out


def reference_step(step: PagedStep, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Write K/V, then run the decode and prefill references on their groups."""
    meta = step.meta
    write_kv(step.key, step.value, step.k_cache, step.v_cache, meta.slot_mapping)
    nd = meta.num_decodes
    out = torch.zeros_like(step.query)
    if nd:
        out[:nd] = paged_decode_attention(
            step.query[:nd], step.k_cache, step.v_cache,
            meta.block_tables[:nd], meta.seq_lens[:nd], step.scale, window, softcap,
        )  # fmt: skip
    if meta.num_reqs > nd:
        qsl = meta.query_start_loc[nd:]
        start, end = int(qsl[0]), int(qsl[-1])
        out[start:end] = paged_prefill_attention(
            step.query[start:end], step.k_cache, step.v_cache,
            meta.block_tables[nd:], qsl - qsl[0], meta.seq_lens[nd:], step.scale, window,
            softcap,
        )  # fmt: skip
    return out


def clone_step(step: PagedStep) -> PagedStep:
    return PagedStep(
        step.query, step.key, step.value, step.k_cache.clone(), step.v_cache.clone(),
        step.meta, step.block_size, step.scale,
    )  # fmt: skip


MIXED = [
    # (seq_lens, q_lens): decodes first, then prefill chunks (first chunks and later ones)
    ([1, 17, 33, 5], [1, 1, 1, 1]),
    ([40], [40]),
    ([7, 100, 64, 37, 130], [1, 1, 64, 20, 50]),
    ([16, 3, 75, 1, 48], [1, 1, 75, 1, 33]),
]


def test_write_kv_skips_padding() -> None:
    step = make_step([5, 20], [1, 20], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4,
                     num_pad_tokens=3)  # fmt: skip
    before_k = step.k_cache.clone()
    write_kv(step.key, step.value, step.k_cache, step.v_cache, step.meta.slot_mapping)
    slots = step.meta.slot_mapping
    k_flat = step.k_cache.view(-1, 2, 8)
    valid = slots >= 0
    torch.testing.assert_close(k_flat[slots[valid]], step.key[valid])
    torch.testing.assert_close(step.v_cache.view(-1, 2, 8)[slots[valid]], step.value[valid])
    untouched = torch.ones(k_flat.shape[0], dtype=torch.bool)
    untouched[slots[valid]] = False
    torch.testing.assert_close(k_flat[untouched], before_k.view(-1, 2, 8)[untouched],
                               equal_nan=True)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", MIXED)
def test_references_match_naive(case, block_size, heads, dtype) -> None:
    seq_lens, q_lens = case
    step = make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                     block_size=block_size, dtype=dtype, num_pad_tokens=2)  # fmt: skip
    out = reference_step(step)
    expected = naive_attention(step)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


# Sliding windows and soft-capping (Gemma 2/3, Mistral): windows below, at and above the
# block size and the contexts; every case has contexts longer than the window.
WINDOWED = [(1, 0.0), (5, 0.0), (16, 0.0), (23, 0.0), (0, 5.0), (7, 2.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), WINDOWED)
@pytest.mark.parametrize("case", MIXED)
def test_windowed_references_match_naive(case, window, softcap, dtype) -> None:
    seq_lens, q_lens = case
    step = make_step(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=32,
                     block_size=16, dtype=dtype, num_pad_tokens=2)  # fmt: skip
    out = reference_step(step, window, softcap)  # writes the step's K/V first
    expected = naive_attention(step, window, softcap)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    plain = naive_attention(step)
    assert not torch.allclose(expected, plain, **TOL[dtype])  # the options change the result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), WINDOWED)
@pytest.mark.parametrize("case", MIXED)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_windowed_backends_match_reference(name, case, window, softcap, dtype) -> None:
    seq_lens, q_lens = case
    step = make_step(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype=dtype, num_pad_tokens=3)  # fmt: skip
    expected = reference_step(clone_step(step), window, softcap)
    backend = get_attention_backend(name, "cpu")
    assert backend.name == name
    backend.prepare(step.meta, 16)
    out = backend.forward(step.query, step.key, step.value, step.k_cache, step.v_cache,
                          step.meta, step.scale, window=window, softcap=softcap)  # fmt: skip
    torch.testing.assert_close(out, expected, **BACKEND_TOL[dtype])
    assert torch.all(out[step.meta.query_start_loc_cpu[-1] :] == 0)


def test_prefill_reference_handles_decodes_too() -> None:
    """A prefill call over q_len-1 requests equals the decode reference."""
    step = make_step([9, 50, 3], [1, 1, 1], num_heads=6, num_kv_heads=2, head_dim=16,
                     block_size=16)  # fmt: skip
    meta = step.meta
    write_kv(step.key, step.value, step.k_cache, step.v_cache, meta.slot_mapping)
    args = (step.k_cache, step.v_cache, meta.block_tables)
    dec = paged_decode_attention(step.query, *args, meta.seq_lens, step.scale)
    pre = paged_prefill_attention(step.query, *args, meta.query_start_loc, meta.seq_lens,
                                  step.scale)  # fmt: skip
    torch.testing.assert_close(dec, pre)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", MIXED)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_torch_backend_matches_reference(name, case, block_size, heads, dtype) -> None:
    seq_lens, q_lens = case
    step = make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                     block_size=block_size, dtype=dtype, num_pad_tokens=3)  # fmt: skip
    ref_step = clone_step(step)
    expected = reference_step(ref_step)
    backend = get_attention_backend(name, "cpu")
    assert backend.name == name
    backend.prepare(step.meta, block_size)
    out = backend.forward(step.query, step.key, step.value, step.k_cache, step.v_cache,
                          step.meta, step.scale)  # fmt: skip
    assert out.dtype == dtype and out.shape == step.query.shape
    torch.testing.assert_close(out, expected, **BACKEND_TOL[dtype])
    torch.testing.assert_close(step.k_cache, ref_step.k_cache, equal_nan=True)
    torch.testing.assert_close(step.v_cache, ref_step.v_cache, equal_nan=True)
    assert torch.all(out[step.meta.query_start_loc_cpu[-1] :] == 0)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_torch_backend_prepare_once_many_layers(name) -> None:
    """One prepare serves every layer (each with its own cache and inputs)."""
    base = make_step([30, 12, 90, 41], [1, 1, 50, 41], num_heads=6, num_kv_heads=2,
                     head_dim=32, block_size=16)  # fmt: skip
    gen = torch.Generator().manual_seed(1)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        return t + torch.randn(t.shape, generator=gen)

    layers = [
        PagedStep(
            noisy(base.query),
            noisy(base.key),
            noisy(base.value),
            noisy(base.k_cache),
            noisy(base.v_cache),
            base.meta,
            base.block_size,
            base.scale,
        )  # fmt: skip
        for _ in range(3)
    ]
    backend = get_attention_backend(name, "cpu")
    assert backend.name == name
    meta = layers[0].meta
    backend.prepare(meta, 16)
    for step in layers:
        expected = reference_step(clone_step(step))
        out = backend.forward(step.query, step.key, step.value, step.k_cache, step.v_cache,
                              meta, step.scale)  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_torch_backend_without_host_lists(name) -> None:
    """prepare falls back to the device tensors when the host-side lists are empty."""
    step = make_step([10, 20, 33], [1, 20, 5], num_heads=4, num_kv_heads=2, head_dim=16,
                     block_size=16)  # fmt: skip
    m = step.meta
    bare = AttentionMetadata(m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables,
                             m.num_decodes, m.max_query_len, m.max_seq_len)  # fmt: skip
    expected = reference_step(clone_step(step))
    backend = get_attention_backend(name, "cpu")
    assert backend.name == name
    backend.prepare(bare, 16)
    out = backend.forward(step.query, step.key, step.value, step.k_cache, step.v_cache, bare,
                          step.scale)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_attention_backend().name == "cpu"  # this machine has a C compiler
    assert isinstance(get_attention_backend("torch"), TorchBackend)
    with pytest.raises(RuntimeError, match="runs on the CPU"):
        get_attention_backend("cpu", "cuda")
    assert get_attention_backend("torch", "cuda").name == "torch"
    assert get_attention_backend("auto", "cuda", KernelSettings(auto_backend="torch")).name == "torch"
    with pytest.raises(ValueError):
        get_attention_backend("flash")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        get_attention_backend("triton", "cpu", KernelSettings(triton_interpret=False))
    # The backend and its layer ops are one choice.
    kernels = select_kernels("cpu", "cpu")
    assert kernels.attention.ops is kernels.ops and kernels.ops.name == "native"
    assert select_kernels("torch", "cpu").ops.name == "torch"
    # The engine's settings come from its environment switches.
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    settings = kernel_settings()
    assert get_attention_backend("auto", "cuda", settings).name == "torch"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        get_attention_backend("triton", "cpu", settings)


def test_cpu_path_does_not_import_triton() -> None:
    code = (
        "import sys\nfrom pagedserve import kernels\n"
        "b = kernels.get_attention_backend('auto', 'cpu')\n"
        "assert b.name == 'cpu'\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_ATTENTION_BACKEND"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_torch_backend_strided_inputs(name) -> None:
    step = make_step([9, 60, 33], [1, 60, 7], num_heads=6, num_kv_heads=2, head_dim=32,
                     block_size=16, num_pad_tokens=1)  # fmt: skip
    expected = reference_step(clone_step(step))
    q, k, v = fused_qkv_views(step)
    assert not q.is_contiguous()
    backend = get_attention_backend(name, "cpu")
    assert backend.name == name
    backend.prepare(step.meta, 16)
    out = backend.forward(q, k, v, step.k_cache, step.v_cache, step.meta, step.scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_registry_rejects_triton_imported_before_interpret_flag() -> None:
    pytest.importorskip("triton")
    code = (
        "import os, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from pagedserve.engine.worker.kernel_settings import kernel_settings\n"
        "from pagedserve.kernels import get_attention_backend\n"
        "try:\n"
        "    get_attention_backend('triton', 'cpu', kernel_settings())\n"
        "except RuntimeError as exc:\n"
        "    assert 'TRITON_INTERPRET' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_decode_buckets_group_similar_lengths() -> None:
    from pagedserve.kernels.torch_backend import MAX_BUCKETS, MIN_BUCKET, decode_buckets

    assert decode_buckets([]) == []
    assert decode_buckets([5, 400, 7]) == [[0, 1, 2]]  # too few rows to split
    lens = [400 - 7 * i for i in range(48)]  # 400 .. 71
    groups = decode_buckets(lens)
    assert sorted(i for g in groups for i in g) == list(range(48))
    assert 1 < len(groups) <= MAX_BUCKETS and all(len(g) >= MIN_BUCKET for g in groups)
    # Every group is padded to its own longest context, far less than one group would be.
    padded = sum(len(g) * max(lens[i] for i in g) for g in groups)
    assert padded < 0.8 * 48 * max(lens)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_torch_backend_many_decodes_in_length_buckets(name) -> None:
    """A large decode batch with spread-out contexts runs in several groups, exactly."""
    from pagedserve.kernels.torch_backend import decode_buckets

    seq_lens = [3 + (i * 37) % 300 for i in range(40)] + [70, 33]
    q_lens = [1] * 40 + [20, 33]
    assert len(decode_buckets(seq_lens[:40])) > 1
    step = make_step(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=32,
                     block_size=16, num_pad_tokens=3)  # fmt: skip
    expected = reference_step(clone_step(step))
    backend = get_attention_backend(name, "cpu")
    assert backend.name == name
    backend.prepare(step.meta, 16)
    out = backend.forward(step.query, step.key, step.value, step.k_cache, step.v_cache,
                          step.meta, step.scale)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Decode-only step (the output is assembled from the groups).
    dec = make_step(seq_lens[:40], [1] * 40, num_heads=6, num_kv_heads=2, head_dim=32,
                    block_size=16)  # fmt: skip
    expected = reference_step(clone_step(dec))
    backend.prepare(dec.meta, 16)
    out = backend.forward(dec.query, dec.key, dec.value, dec.k_cache, dec.v_cache, dec.meta,
                          dec.scale)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["torch"])
def test_whole_prompt_chunks_use_causal_calls(name) -> None:
    """Whole-context chunks attend with their own causal call, others through the cache;
    past MAX_CAUSAL_CALLS every chunk goes into one padded call. All exact. (The cpu
    backend attends every row natively: tests/kernels/cpu/test_native.py.)"""
    from pagedserve.kernels.torch_backend import MAX_CAUSAL_CALLS

    few = ([9, 30, 17, 64, 50], [1, 30, 17, 20, 50])  # a decode, 3 whole prompts, 1 later chunk
    many_n = MAX_CAUSAL_CALLS + 4
    many = ([5 + i % 23 for i in range(many_n)] + [70], [5 + i % 23 for i in range(many_n)] + [9])
    for (seq_lens, q_lens), expect_causal in ((few, 3), (many, 0)):
        step = make_step(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=32,
                         block_size=16, num_pad_tokens=2)  # fmt: skip
        expected = reference_step(clone_step(step))
        backend = get_attention_backend(name, "cpu")
        backend.prepare(step.meta, 16)
        assert len(step.meta.prepared.causal) == expect_causal
        out = backend.forward(step.query, step.key, step.value, step.k_cache, step.v_cache,
                              step.meta, step.scale)  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert torch.all(out[step.meta.query_start_loc_cpu[-1] :] == 0)
