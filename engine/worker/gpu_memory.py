"""Sizing the KV cache on a CUDA device by profiling one worst-case step.

The KV cache gets what is left of ``total * gpu_memory_utilization`` once everything
else that can be resident at the same time is paid for::

    kv_budget = total * utilization - weights - activation_peak - graph_reserve - non_torch
                - lora_reserve

* ``weights``: torch memory allocated when profiling starts (the model and its tables).
* ``activation_peak``: the peak of torch allocations above that during one dummy step of
  ``max_num_batched_tokens`` tokens (the largest step the scheduler can build: a burst
  of prefills fills exactly this budget, beside up to ``max_num_seqs - 1`` decodes at
  ``max_model_len``, whose split-KV scratch is measured with it) followed by the
  sampler on ``max_num_seqs`` rows of float32 logits with the costliest sampling options. Sizing from this peak is
  what keeps a burst of prefill chunks from running out of memory once the cache is
  allocated.
* ``graph_reserve``: when decode CUDA graphs will be captured, what one decode step at
  the largest captured batch makes the allocator reserve (whole segments, not the bytes
  allocated in them: the graphs' private pool keeps its segments for good).
* ``non_torch``: device memory used outside torch's allocator (CUDA context, cuBLAS and
  Triton modules, other processes), from ``cuda.mem_get_info`` after the dummy step.
* ``lora_reserve``: with ``enable_lora``, the adapters kept loaded (``max_cpu_loras``)
  at ``max_lora_rank`` on every projection (:meth:`LoRALimits.adapter_bytes`).

The arithmetic is :func:`kv_cache_budget`, a pure function; :func:`profile_kv_budget`
gathers the numbers on the device.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from pagedserve.blockmgr import cdiv
from pagedserve.engine.errors import KVBudgetError
from pagedserve.kernels.interface import AttentionBackend, AttentionMetadata, kv_row_width

logger = logging.getLogger("pagedserve.engine.worker.gpu_memory")

GiB = 2**30
DUMMY_CACHE_BLOCKS = 4
"""Physical blocks of the temporary cache the dummy steps attend over (every logical
block of their block tables maps onto one of these; the layers share it)."""


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """The numbers the KV budget is computed from, in bytes."""

    total: int
    utilization: float
    weights: int
    activation_peak: int
    graph_reserve: int
    non_torch: int
    lora_reserve: int = 0

    @property
    def kv_budget(self) -> float:
        return kv_cache_budget(self.total, self.utilization, self.weights,
                               self.activation_peak, self.non_torch, self.graph_reserve,
                               self.lora_reserve)  # fmt: skip


def kv_cache_budget(
    total: float,
    utilization: float,
    weights: float,
    activation_peak: float,
    non_torch: float,
    graph_reserve: float = 0.0,
    lora_reserve: float = 0.0,
) -> float:
    """Bytes left for the KV cache; raises :class:`KVBudgetError` when none are.

    All sizes in bytes; ``utilization`` is the fraction of ``total`` the engine may use.
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization={utilization} must be in (0, 1]")
    if min(total, weights, activation_peak, non_torch, graph_reserve, lora_reserve) < 0:
        raise ValueError("memory sizes must be >= 0")
    allowed = total * utilization
    budget = allowed - weights - activation_peak - graph_reserve - non_torch - lora_reserve
    if budget <= 0:
        raise KVBudgetError(
            f"no GPU memory is left for the KV cache: {utilization:.2f} x "
            f"{total / GiB:.2f} GiB = {allowed / GiB:.2f} GiB allowed, but weights take "
            f"{weights / GiB:.2f} GiB, the activation peak of a "
            f"max_num_batched_tokens step {activation_peak / GiB:.2f} GiB, CUDA graphs "
            f"{graph_reserve / GiB:.2f} GiB, LoRA adapters {lora_reserve / GiB:.2f} GiB and "
            f"memory outside torch (CUDA context, other processes) {non_torch / GiB:.2f} "
            f"GiB ({budget / GiB:.2f} GiB left). Raise "
            "gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, set "
            "enforce_eager, use a smaller model or dtype, or free the GPU"
        )
    return budget


def kv_cache_blocks(budget: float, block_bytes: int) -> int:
    """Whole KV blocks of ``block_bytes`` that fit ``budget`` bytes."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes={block_bytes} must be > 0")
    return int(budget // block_bytes)


def dummy_step_layout(num_tokens: int, max_model_len: int,
                      num_decodes: int = 0) -> list[tuple[int, int]]:  # fmt: skip
    """``(q_len, seq_len)`` per request of a profiling step of ``num_tokens`` tokens.

    Up to ``num_decodes`` decodes (at most ``num_tokens - 1``: a prefill chunk always
    runs), then prefill chunks of up to ``max_model_len`` tokens, every request at a
    context of ``max_model_len`` tokens (the most any attends over); one-token chunks come
    first, as the kernels' contract requires of decodes.
    """
    if num_tokens < 1 or max_model_len < 1 or num_decodes < 0:
        raise ValueError(f"num_tokens={num_tokens} and max_model_len={max_model_len} "
                         f"must be >= 1, num_decodes={num_decodes} >= 0")  # fmt: skip
    decodes = min(num_decodes, num_tokens - 1)
    layout: list[tuple[int, int]] = [(1, max_model_len)] * decodes
    left = num_tokens - decodes
    while left:
        q = min(left, max_model_len)
        layout.append((q, max_model_len))
        left -= q
    return sorted(layout, key=lambda x: x[0] != 1)


@dataclass(slots=True)
class DummyStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def build_dummy_step(
    layout: list[tuple[int, int]],
    block_size: int,
    num_cache_blocks: int,
    device: torch.device | str,
) -> DummyStep:
    """Token 0 everywhere; logical block ``j`` of every request maps onto physical block
    ``j % num_cache_blocks``, so the attention reads (and the KV writes land) in a cache
    of only ``num_cache_blocks`` blocks."""
    qsl = [0]
    seq_lens: list[int] = []
    positions: list[int] = []
    for q, s in layout:
        if not 1 <= q <= s:
            raise ValueError(f"bad (q_len, seq_len)=({q}, {s})")
        qsl.append(qsl[-1] + q)
        seq_lens.append(s)
        positions.extend(range(s - q, s))
    num_decodes = 0
    while num_decodes < len(layout) and layout[num_decodes][0] == 1:
        num_decodes += 1
    if any(q == 1 for q, _ in layout[num_decodes:]):
        raise ValueError("one-token requests must come first")
    width = cdiv(max(seq_lens), block_size)
    row = torch.arange(width, dtype=torch.int32) % num_cache_blocks
    tables = row.repeat(len(layout), 1)
    pos = torch.tensor(positions, dtype=torch.int64)
    slots = (pos // block_size) % num_cache_blocks * block_size + pos % block_size
    meta = AttentionMetadata.from_host(slots, qsl, seq_lens, tables, num_decodes, device)
    return DummyStep(torch.zeros(qsl[-1], dtype=torch.int64, device=device),
                     pos.to(device), meta)  # fmt: skip


def dummy_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One small K/V cache pair shared by every layer (an int8 cache's rows with room for
    their scales)."""
    shape = (num_blocks, block_size, num_kv_heads, kv_row_width(head_dim, dtype))
    k = torch.zeros(shape, dtype=dtype, device=device)
    v = torch.zeros(shape, dtype=dtype, device=device)
    return [(k, v)] * num_layers


def heavy_sampling_rows(num_rows: int, vocab_size: int) -> list[Any]:
    """Sampler rows that take every costly path: penalties, top-k, top-p, min-p and
    logprobs (the sampler copies the logits for each)."""
    from pagedserve.engine.core.sampling_params import SamplingParams
    from pagedserve.engine.sample.sampler import SamplingRow

    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01,
                            repetition_penalty=1.1, presence_penalty=0.5,
                            frequency_penalty=0.5, logprobs=5, max_tokens=16)  # fmt: skip
    ids = list(range(min(16, vocab_size)))
    return [SamplingRow(params=params, prompt_token_ids=ids, output_token_ids=ids,
                        generator=None, key=f"profile-{i}") for i in range(num_rows)]  # fmt: skip


def run_dummy_step(
    model: Any,
    attn: AttentionBackend,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    step: DummyStep,
    block_size: int,
    num_sample_rows: int = 0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The model on ``step``, then (``num_sample_rows`` > 0) logits for that many rows
    (cycling over the step's tokens) and the sampler on them; returns the hidden states."""
    with torch.inference_mode():
        attn.prepare(step.meta, block_size)
        hidden = model(step.input_ids, step.positions, kv_caches, step.meta, attn)
        if num_sample_rows:
            from pagedserve.engine.sample.sampler import Sampler

            vocab = vocab_size or model.spec.vocab_size
            idx = torch.arange(num_sample_rows, device=hidden.device) % hidden.shape[0]
            logits = model.compute_logits(hidden[idx], attn.ops)
            Sampler(vocab)(logits, heavy_sampling_rows(num_sample_rows, vocab))
            del logits
    return hidden


def _peak_above_current(fn: Callable[[], Any], device: torch.device,
                        reserved: bool = False) -> int:  # fmt: skip
    """Peak torch allocation above the current one while ``fn`` runs (``reserved``: of
    the allocator's reserved segments, after returning the cached free ones)."""
    if reserved:
        gc.collect()
        torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    current, peak_of = ((torch.cuda.memory_reserved, torch.cuda.max_memory_reserved) if reserved
                        else (torch.cuda.memory_allocated, torch.cuda.max_memory_allocated))  # fmt: skip
    base = current(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = peak_of(device) - base
    del out
    return max(0, peak)


def profile_kv_budget(worker: Any) -> float:
    """KV cache bytes for ``worker`` (an :class:`pagedserve.engine.worker.worker.Worker` with its model and
    attention backend on a CUDA device, before its cache exists); logs the numbers."""
    from pagedserve.engine.worker.cuda_graphs import capture_sizes, graphs_wanted

    cfg = worker.config
    device = worker.settings.device
    spec = worker.spec
    block_size = cfg.block_size
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device)

    kv_caches = dummy_kv_caches(spec.num_layers, DUMMY_CACHE_BLOCKS, block_size, spec.num_kv_heads,
                                spec.head_dim, worker.kv_dtype, device)  # fmt: skip
    num_tokens = worker.settings.max_num_batched_tokens
    layout = dummy_step_layout(num_tokens, worker.settings.max_model_len, cfg.max_num_seqs - 1)
    step = build_dummy_step(layout, block_size, DUMMY_CACHE_BLOCKS, device)
    sample_rows = cfg.max_num_seqs
    activation = _peak_above_current(
        partial(run_dummy_step, worker.model, worker.attn, kv_caches, step, block_size, sample_rows,
                worker.settings.vocab_size), device)  # fmt: skip
    del step
    graph_reserve = 0
    graph_batch = 0
    if graphs_wanted(device, cfg.enforce_eager, worker.attn, worker.model):
        graph_batch = capture_sizes(cfg.max_num_seqs)[-1]
        decode = build_dummy_step([(1, worker.settings.max_model_len)] * graph_batch, block_size,
                                  DUMMY_CACHE_BLOCKS, device)  # fmt: skip
        graph_reserve = _peak_above_current(
            partial(run_dummy_step, worker.model, worker.attn, kv_caches, decode, block_size), device,
            reserved=True)  # fmt: skip
        del decode
    del kv_caches
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    lora_reserve = 0
    if cfg.enable_lora:
        from pagedserve.engine.lora.request import LoRALimits

        lora_reserve = cfg.lora_capacity * LoRALimits.of(spec, cfg.max_lora_rank).adapter_bytes(
            worker.settings.dtype.itemsize)
    prof = MemoryProfile(total=total, utilization=cfg.gpu_memory_utilization, weights=weights,
                         activation_peak=activation, graph_reserve=graph_reserve,
                         non_torch=non_torch, lora_reserve=lora_reserve)  # fmt: skip
    logger.info(
        "GPU memory: total %.2f GiB x utilization %.2f = %.2f GiB; weights %.2f GiB; "
        "activation peak %.2f GiB (%d tokens, sampler on %d rows); CUDA graph reserve "
        "%.2f GiB (decode batch %d); LoRA adapters %.2f GiB; outside torch %.2f GiB",
        total / GiB, prof.utilization, total * prof.utilization / GiB, weights / GiB,
        activation / GiB, num_tokens, sample_rows, graph_reserve / GiB, graph_batch,
        lora_reserve / GiB, non_torch / GiB)  # fmt: skip
    budget = prof.kv_budget
    logger.info("KV cache budget: %.2f GiB (%d blocks of %d bytes)", budget / GiB,
                kv_cache_blocks(budget, worker.block_bytes()), worker.block_bytes())  # fmt: skip
    return budget
