"""Compiling every kernel variant the engine can launch before it serves.

Triton compiles a kernel the first time it sees a new specialization (its constexprs,
and for each integer and pointer argument whether it is 1 and whether it is divisible
by 16); a compile on the engine thread mid-serving stalls every running request for a
second or more. The Triton backend keeps those keys fixed for a model (whole tensors
plus offsets, ``do_not_specialize`` on the integers that vary), so the variants are
few: the KV write, the prefill kernel, and the decode kernel with one split and with
several (and its reduce). :func:`warm_up_kernels` runs the model over two small dummy
steps that launch each of them once, writing only the first blocks of the cache, which
no request holds yet.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pagedserve.engine.worker.gpu_memory import DUMMY_CACHE_BLOCKS, build_dummy_step

logger = logging.getLogger("pagedserve.engine.worker.kernel_warmup")

SPLIT_CONTEXT = 512
"""Context of the warm-up decode that splits (two splits of the decode kernel's
minimum, wherever splitting one request pays)."""


def warm_up_layouts(max_model_len: int, max_num_batched_tokens: int) -> list[list[tuple[int, int]]]:
    """``(q_len, seq_len)`` per request of each warm-up step: a decode over a short
    context (one split), then a decode over a long one (several splits) beside a
    prefill chunk (a mixed step)."""
    long_ctx = min(max_model_len, SPLIT_CONTEXT)
    chunk = max(2, min(8, max_num_batched_tokens - 1, max_model_len))
    return [[(1, min(16, max_model_len))], [(1, long_ctx), (chunk, chunk)]]


@torch.inference_mode()
def warm_up_kernels(worker: Any) -> float:
    """Launch every kernel variant of ``worker``'s backend once (before the decode graphs
    are captured, before serving); returns the seconds taken."""
    t0 = time.perf_counter()
    runner = worker.runner
    for layout in warm_up_layouts(worker.settings.max_model_len, worker.settings.max_num_batched_tokens):
        step = build_dummy_step(layout, worker.config.block_size,
                                min(DUMMY_CACHE_BLOCKS, worker.num_blocks), worker.settings.device)  # fmt: skip
        worker.attn.prepare(step.meta, worker.config.block_size)
        worker.model(step.input_ids, step.positions, runner.kv_caches, step.meta, worker.attn)
    if worker.settings.device.type == "cuda":
        torch.cuda.synchronize(worker.settings.device)
    seconds = time.perf_counter() - t0
    logger.info("kernels warmed up in %.2fs", seconds)
    return seconds
