"""HF transformers baselines on a benchmark workload.

Two ways of running the same requests with greedy decoding:

* static batching: ``model.generate`` over fixed batches with left padding. Every row
  of a batch generates the batch's longest output (``min_new_tokens`` keeps EOS from
  ending a row early); only each request's requested tokens count as useful output.
* continuous batching: transformers' own paged continuous batching (the manager
  behind ``model.generate_batch``), with each request's own ``max_new_tokens`` and EOS
  disabled, so it computes exactly the workload.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.loadtest.workloads import Workload

logger = logging.getLogger("pagedserve.loadtest")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class HFRun:
    """One HF baseline run."""

    name: str
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    """Useful output: each request's requested tokens."""
    num_generated_tokens: int
    """Every token generated, including rows kept running for a longer batch-mate."""
    settings: dict[str, Any] = field(default_factory=dict)
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "elapsed_s": self.elapsed_s,
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "requests_per_s": self.num_requests / self.elapsed_s,
            "output_tokens_per_s": self.num_output_tokens / self.elapsed_s,
            "total_tokens_per_s":
                (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s,
            **self.settings,
        }


def load_hf_model(path: str | Path, dtype: str):
    """The HF model in ``dtype`` with SDPA attention (also what continuous batching uses)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = _DTYPES["float32" if dtype == "auto" else dtype]
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch_dtype, attn_implementation="sdpa")
    return model.eval()


def _pad_id(model) -> int:
    cfg = model.generation_config
    for v in (cfg.pad_token_id, model.config.pad_token_id, cfg.eos_token_id):
        if isinstance(v, int):
            return v
        if isinstance(v, list) and v:
            return int(v[0])
    return 0


@torch.inference_mode()
def run_static(model, workload: Workload, batch_size: int) -> HFRun:
    """``model.generate`` over batches of ``batch_size`` requests in workload order."""
    from transformers import GenerationConfig

    pad = _pad_id(model)
    reqs = workload.requests
    outputs: list[list[int]] = []
    generated = 0
    elapsed = 0.0
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b:b + batch_size]
        max_in = max(len(r.prompt_token_ids) for r in batch)
        max_out = max(r.output_len for r in batch)
        ids = torch.full((len(batch), max_in), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), max_in), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding
            n = len(r.prompt_token_ids)
            ids[i, max_in - n:] = torch.tensor(r.prompt_token_ids)
            mask[i, max_in - n:] = 1
        gen = GenerationConfig(
            do_sample=False, max_new_tokens=max_out, min_new_tokens=max_out,
            pad_token_id=pad, eos_token_id=model.generation_config.eos_token_id,
            bos_token_id=model.generation_config.bos_token_id)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        elapsed += time.perf_counter() - t0
        new = out[:, max_in:]
        generated += new.numel()
        for i, r in enumerate(batch):
            outputs.append(new[i, : r.output_len].tolist())
    return HFRun(
        name="hf_static",
        elapsed_s=elapsed,
        num_requests=len(reqs),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=sum(len(o) for o in outputs),
        num_generated_tokens=generated,
        settings={"batch_size": batch_size, "padding": "left"},
        output_token_ids=outputs,
    )


def kv_bytes_per_token(model) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    elem = torch.empty((), dtype=model.dtype).element_size()
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * elem


@torch.inference_mode()
def run_continuous(
    model,
    workload: Workload,
    kv_cache_gb: float,
    max_batch_tokens: int,
    max_requests: int,
    page_size: int = 256,
    timeout_s: float = 3600.0,
) -> HFRun:
    """transformers' continuous batching: the manager behind ``model.generate_batch``.

    Requests are added one by one with their own ``max_new_tokens`` and EOS disabled
    (``generate_batch`` takes one ``max_new_tokens`` for all). The KV cache is sized to
    ``kv_cache_gb`` (the engine's) instead of a fraction of free memory. Timing starts
    after the manager's warm-up, at the first request.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    reqs = workload.requests
    need = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    num_blocks = max(int(kv_cache_gb * 2**30 // (kv_bytes_per_token(model) * page_size)),
                     math.ceil(need / page_size))
    cb = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests, allow_block_sharing=False,
        auto_switch_to_flash=False, seed=0)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model),
                           max_new_tokens=max(r.output_len for r in reqs))
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True,
            timeout=30) as manager:
        t0 = time.perf_counter()
        ids = [manager.add_request(list(r.prompt_token_ids), request_id=f"bench-{i}",
                                   max_new_tokens=r.output_len, eos_token_id=-1)
               for i, r in enumerate(reqs)]
        deadline = t0 + timeout_s
        while len(results) < len(ids):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"continuous batching did not finish in {timeout_s:.0f}s")
        elapsed = time.perf_counter() - t0
    errors = [rid for rid, r in results.items() if getattr(r, "error", None)]
    if errors:
        raise RuntimeError(f"continuous batching failed requests {errors[:4]}")
    outputs = [list(results[rid].generated_tokens) for rid in ids]
    return HFRun(
        name="hf_continuous",
        elapsed_s=elapsed,
        num_requests=len(reqs),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=sum(min(len(o), r.output_len) for o, r in zip(outputs, reqs, strict=True)),
        num_generated_tokens=sum(len(o) for o in outputs),
        settings={"attn_implementation": model.config._attn_implementation,
                  "page_size": page_size, "num_blocks": num_blocks,
                  "max_batch_tokens": max_batch_tokens, "max_requests_per_batch": max_requests},
        output_token_ids=outputs,
    )


def warm_up_static(model, workload: Workload) -> None:
    """A tiny ``generate`` so one-time setup stays out of the static-batching timing."""
    from pagedserve.loadtest.workloads import BenchRequest

    small = Workload("warmup", [BenchRequest(r.prompt_token_ids[:16], 4)
                                for r in workload.requests[:2]], {})
    run_static(model, small, 2)


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two sets of greedy outputs agree, request by request.

    ``identical``: fraction of requests with identical outputs; ``common_prefix``: mean
    fraction of each output before the first differing token.
    """
    if not a:
        return {"identical": 0.0, "common_prefix": 0.0}
    same = 0
    frac = 0.0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        same += x == y
        frac += n / max(len(x), len(y), 1)
    return {"identical": same / len(a), "common_prefix": frac / len(a)}
