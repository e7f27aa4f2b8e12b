"""The bfloat16 gate of the GPU check (``gpu_check.py gate``), bfloat16 being the
production dtype.

In this order (the summary gets a line per check as it finishes, so a run cut short
keeps what it measured):

* kernels: the Triton KV write, decode and prefill kernels against the torch reference
  for head dims 64/80/96/128 and GQA groups 1/7/16, and over a KV cache of more than
  2^31 elements per layer with the blocks at the top of its range;
* engines: Triton with decode CUDA graphs, Triton eager and the torch backend on a random
  bf16 model, batches of 3, 17 and 255 requests (off the capture ladder) and prompts of
  3K+ tokens: the first token's logprob within a bf16 tolerance, greedy agreement
  reported, and no Triton compile after the engine's warm-up;
* step split: the host's prepare, within it the staging (the host buffer filled and its
  one copy into the graphs' static buffers), the replay and the sampling of decode steps
  at batch 1/16/64/256 (each timed with a device sync around it). Decode-attention bandwidth against the card's peak is the ``bandwidth`` part.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KERNEL_CASES = [(64, 1), (64, 16), (80, 7), (96, 1), (96, 16), (128, 7), (128, 16)]
"""(head_dim, GQA group): every head dim and every group at least once."""
ENGINE_BATCHES = (3, 17, 255)
KERNEL_CASE_BLOCKS = 96
"""Cache size of the kernel cases: their 72 blocks and the null block fit."""
LONG_PROMPTS = (3072, 3500, 4000)
STEP_BATCHES = (1, 16, 64, 256)
LOGPROB_TOL = 0.15
"""Largest difference of a first token's logprob between two engines (bf16 logits)."""


def add_parser(sub: Any) -> None:
    g = sub.add_parser("gate", help="the bf16 gate: engines, kernels, compiles, step split")
    g.add_argument("--workdir", required=True, help="where the random model is written")
    g.add_argument("--new-tokens", type=int, default=8)


def gate_config():
    """A small random Llama (head_dim 64, GQA 4) with room for 8K contexts."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # fmt: skip


def workloads(seed: int = 0) -> dict[str, list[list[int]]]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def draw(lens):
        return [torch.randint(100, 8000, (n,), generator=gen).tolist() for n in lens]

    out = {f"batch {b}": draw([5 + (7 * i) % 90 for i in range(b)]) for b in ENGINE_BATCHES}
    out["3K+ prompts"] = draw(LONG_PROMPTS)
    return out


def cmd_gate(args: argparse.Namespace, before_cuda: Callable, emit: Callable,
             write_model: Callable) -> int:  # fmt: skip
    model = write_model(Path(args.workdir) / "gate-model", gate_config())
    loads = workloads()
    before_cuda(args, f"kernel cases {KERNEL_CASES}, engines on {sorted(loads)}, "
                      f"step split at {STEP_BATCHES}")  # fmt: skip
    failed = check_kernels(lambda line: emit(args.summary, line))
    failed += check_engines(model, loads, args.new_tokens, lambda line: emit(args.summary, line))
    step_split(model, lambda line: emit(args.summary, line))
    return 1 if failed else 0


# -- kernels ---------------------------------------------------------------------------------
def _kernel_case(d: int, group: int, num_blocks: int, top: bool, dtype, dev: str = "cuda") -> float:
    """Max error of write + decode + prefill against the torch reference.

    ``num_blocks`` is the cache's size; the five requests' 72 blocks sit right after the
    null block 0 or (``top``) at the top of the cache.
    """
    import torch

    from pagedserve.kernels import torch_ref
    from pagedserve.kernels.triton.decode import paged_decode_attention
    from pagedserve.kernels.triton.prefill import paged_prefill_attention
    from pagedserve.kernels.triton.write_kv import write_kv

    bs, hkv = 16, 2 if group < 16 else 1
    hq = group * hkv
    gen = torch.Generator(device=dev).manual_seed(d + group)
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    seq_lens, q_lens = [700, 33, 1, 300, 77], [1, 1, 1, 300, 20]
    per = [-(-s // bs) for s in seq_lens]
    if num_blocks < sum(per) + 1:
        raise ValueError(f"num_blocks={num_blocks}: the case needs at least {sum(per) + 1}")
    first = num_blocks - sum(per) if top else 1
    ids = torch.arange(first, first + sum(per), device=dev).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per), dtype=torch.int32, device=dev)
    off = 0
    for i, n in enumerate(per):
        tables[i, :n] = ids[off:off + n].flip(0)
        off += n
    for i, s in enumerate(seq_lens):  # the cached context
        ctx = torch.arange(s, device=dev)
        slots = tables[i, ctx // bs].long() * bs + ctx % bs
        for cache in (k_cache, v_cache):
            cache.view(-1, hkv, d)[slots] = torch.randn(s, hkv, d, generator=gen,
                                                        device=dev).to(dtype)  # fmt: skip
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=gen, device=dev).to(dtype)
    kv = torch.randn(2, t, hkv, d, generator=gen, device=dev).to(dtype)
    pos = torch.cat([torch.arange(s - n, s, device=dev) for s, n in zip(seq_lens, q_lens, strict=True)])
    req = torch.repeat_interleave(torch.arange(len(q_lens), device=dev),
                                  torch.tensor(q_lens, device=dev))  # fmt: skip
    slot_mapping = tables[req, pos // bs].long() * bs + pos % bs
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_ref.write_kv(kv[0], kv[1], ref_k, ref_v, slot_mapping)
    write_kv(kv[0], kv[1], k_cache, v_cache, slot_mapping)
    err = float((k_cache.float() - ref_k.float()).abs().max())
    del ref_k, ref_v
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=dev)  # fmt: skip
    scale = d**-0.5
    nd = 3
    got = paged_decode_attention(q[:nd], k_cache, v_cache, tables, lens, scale, max_seq_len=700)
    want = torch_ref.paged_decode_attention(q[:nd], k_cache, v_cache, tables[:nd], lens[:nd],
                                            scale)  # fmt: skip
    err = max(err, float((got.float() - want.float()).abs().max()))
    got = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, scale, first_req=nd)
    want = torch_ref.paged_prefill_attention(q, k_cache, v_cache, tables[nd:], qsl[nd:],
                                             lens[nd:], scale)  # fmt: skip
    return max(err, float((got[nd:].float() - want[nd:].float()).abs().max()))


def check_kernels(say: Callable[[str], None]) -> int:
    import torch

    failed = 0
    for d, group in KERNEL_CASES:
        err = _kernel_case(d, group, KERNEL_CASE_BLOCKS, False, torch.bfloat16)
        ok = err <= 3e-2
        failed += not ok
        say(f"gate kernels: D={d} group={group:2d} bf16 max err {err:.2e} "
            f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    # > 2^31 elements per layer (K and V 4 GiB each in bf16), blocks at the top.
    num_blocks = 2**31 // (16 * 1 * 128) + 64
    err = _kernel_case(128, 16, num_blocks, True, torch.bfloat16)
    ok = err <= 3e-2
    say(f"gate kernels: {num_blocks * 16 * 128 / 2**31:.3f} x 2^31 elements per layer, top "
        f"blocks, bf16 max err {err:.2e} {'PASS' if ok else 'FAIL'}")  # fmt: skip
    torch.cuda.empty_cache()
    return failed + (not ok)


# -- engines ---------------------------------------------------------------------------------
def compiled_variants() -> int:
    """Compiled Triton variants of the engine's kernels so far (every device)."""
    from tests.helpers.triton_keys import triton_kernels

    total = 0
    for kernel in triton_kernels():
        for cache in getattr(kernel, "device_caches", {}).values():
            total += len(cache[0])
    return total


def _engine_run(model: Path, prompts, new_tokens: int, **kw):
    import gc

    import torch

    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=8192, max_num_seqs=256,
              enable_prefix_caching=False, **kw)  # fmt: skip
    warm = compiled_variants()
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens,
                        logprobs=1)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    new = compiled_variants() - warm
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    first = [o.outputs[0].logprobs[0].logprob for o in outs]
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, first, new


def check_engines(model: Path, loads, new_tokens: int, say: Callable[[str], None]) -> int:
    failed = 0
    for name, prompts in loads.items():
        runs = {"graphs": _engine_run(model, prompts, new_tokens, attention_backend="triton"),
                "eager": _engine_run(model, prompts, new_tokens, attention_backend="triton",
                                     enforce_eager=True),
                "torch": _engine_run(model, prompts, new_tokens, attention_backend="torch")}  # fmt: skip
        ref_tokens, ref_first, _ = runs["torch"]
        for what in ("graphs", "eager"):
            tokens, first, new = runs[what]
            diff = max(abs(a - b) for a, b in zip(first, ref_first, strict=True))
            same = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))
            ok = diff <= LOGPROB_TOL and new == 0
            failed += not ok
            say(f"gate engines: {name}: triton {what} vs torch: first-token logprob max diff "
                f"{diff:.3f} (tol {LOGPROB_TOL}), greedy identical {same}/{len(tokens)}, "
                f"{new} compiles after warm-up {'PASS' if ok else 'FAIL'}")  # fmt: skip
    return failed


# -- step split ------------------------------------------------------------------------------
def _timed(times: list[float], fn: Callable) -> Callable:
    import torch

    def wrapper(*a, **kw):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        return out

    return wrapper


class _TimedCalls:
    """``obj`` with its calls timed into ``times``; its other attributes pass through."""

    def __init__(self, times: list[float], obj: Any) -> None:
        self._call = _timed(times, obj)
        self._obj = obj

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obj, name)


def step_split(model: Path, say: Callable[[str], None]) -> None:
    """Median microseconds of each part of a decode step, per batch size."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=8192, max_num_seqs=256,
              attention_backend="triton")  # fmt: skip
    runner = llm.engine.worker.runner
    graphs = runner.decode_graphs
    parts: dict[str, list[float]] = {k: [] for k in ("prepare", "stage", "replay", "sample")}
    runner.prepare = _timed(parts["prepare"], runner.prepare)
    runner.staging.stage = _timed(parts["stage"], runner.staging.stage)
    for graph in graphs.graphs.values():
        graph.replay = _timed(parts["replay"], graph.replay)
    runner.sampler = _TimedCalls(parts["sample"], runner.sampler)
    sp = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    for batch in STEP_BATCHES:
        for v in parts.values():
            v.clear()
        prompts = [[100 + i, 200 + i, 300 + i] for i in range(batch)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        med = {k: 1e6 * statistics.median(v[-16:]) if v else float("nan")
               for k, v in parts.items()}  # fmt: skip
        say(f"gate step split: batch {batch:3d}: " + ", ".join(
            f"{k} {v:7.1f} us" for k, v in med.items()))  # fmt: skip
