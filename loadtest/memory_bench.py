"""Memory: the weights a GGUF file keeps resident, and the KV cache of a sliding-window model.

``--gguf FILE`` serves the file with ``quantization="gguf"`` and compares the bytes its
weights hold once loaded (every tensor the model and its kernels keep, each storage counted
once; and the process's resident-set growth less the KV cache) with the file's tensor
bytes::

    pagedserve bench memory --gguf SmolLM2-135M-Instruct.Q4_K_M.gguf

``--kv-window`` runs one long request on a random-weight model with Gemma 3's KV shape
(by default Gemma 3 1B's: 26 layers, five sliding over 512 positions to one full, one
KV head of 256) and reports the KV bytes it holds at its peak and at its end, against a
cache that keeps every position of every layer::

    pagedserve bench memory --kv-window --prompt-len 8192
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pagedserve.loadtest.bench_common import cpu_model, save_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", help="a GGUF file: its resident weights against its tensor bytes")
    p.add_argument("--kv-window", action="store_true",
                   help="the KV bytes of one long request on a Gemma 3-shaped model")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--num-layers", type=int, default=26)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--pattern", type=int, default=6,
                   help="every PATTERN-th layer attends to the whole context")
    p.add_argument("--num-kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="the KV cache of the --kv-window run")
    p.add_argument("--output-json")


def _rss() -> int:
    """The process's private resident bytes (``RssAnon``: file pages, such as the mapped
    GGUF the loader reads, are the page cache's)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    with open("/proc/self/statm") as f:  # no RssAnon: the whole resident set
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor_bytes(objs: Any) -> int:
    """Bytes of every distinct storage among the tensors reachable from ``objs`` (modules,
    their attributes, lists, tuples, dicts, dataclasses)."""
    import torch

    seen_storage: set[int] = set()
    seen: set[int] = set()
    total = 0
    stack = list(objs)
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type == "meta":
                continue
            s = o.untyped_storage()
            if s.data_ptr() not in seen_storage:
                seen_storage.add(s.data_ptr())
                total += s.nbytes()
            continue
        if isinstance(o, torch.nn.Module):
            stack.extend(o.parameters(recurse=False))
            stack.extend(o.buffers(recurse=False))
            stack.extend(o.children())
            stack.extend(v for v in vars(o).values() if not isinstance(v, torch.nn.Module))
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__") or hasattr(o, "__slots__"):
            names = list(getattr(o, "__dict__", {}))
            for cls in type(o).__mro__:
                names += [n for n in getattr(cls, "__slots__", ()) if isinstance(n, str)]
            stack.extend(getattr(o, n, None) for n in names)
    return total


def gguf_memory(path: str) -> dict[str, Any]:
    import gc

    import gguf

    from pagedserve import LLM

    reader = gguf.GGUFReader(path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    kinds: dict[str, int] = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + int(t.n_bytes)
    del reader
    gc.collect()
    before = _rss()
    llm = LLM(path, quantization="gguf", kv_cache_memory_gb=0.01)
    gc.collect()
    after = _rss()
    worker = llm.engine.worker
    kv = worker.kv_cache.numel() * worker.kv_cache.element_size()
    held = _tensor_bytes([worker.model, worker.attn])
    llm.engine.close()
    return {
        "gguf": str(path), "quant": worker.quant_desc, "gguf_tensor_bytes": file_bytes,
        "gguf_bytes_by_type": kinds, "weights_tensor_bytes": held,
        "weights_over_file": held / file_bytes, "rss_growth_less_kv": after - before - kv,
        "rss_over_file": (after - before - kv) / file_bytes,
    }


def kv_window_memory(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.loader import convert_default_model, load_tokenizer

    layer_types = ["full_attention" if (i + 1) % args.pattern == 0 else "sliding_attention"
                   for i in range(args.num_layers)]  # fmt: skip
    cfg = transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=args.num_layers,
        num_attention_heads=1, num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim,
        query_pre_attn_scalar=args.head_dim, sliding_window=args.window,
        layer_types=layer_types, max_position_embeddings=args.prompt_len + 64,
        tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0}})  # fmt: skip
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        transformers.Gemma3ForCausalLM(cfg).save_pretrained(d)
        load_tokenizer(convert_default_model()).save_pretrained(d)  # the default model's
        llm = LLM(d, dtype="float32", block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory_gb=args.kv_cache_memory_gb, enable_prefix_caching=False)
        eng = llm.engine
        ids = [(37 * i) % 20000 + 100 for i in range(args.prompt_len)]
        eng.add_request("long", ids, SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))  # fmt: skip
        (rid,) = eng.scheduler.requests
        held = []
        while eng.has_unfinished_requests():
            eng.step()
            if eng.kv.num_allocated_blocks(rid):
                held.append(eng.kv.num_allocated_blocks(rid))
        worker = eng.worker
        elem = worker.kv_cache.element_size()
        block = worker.block_bytes()
        per_layer_block = 2 * args.block_size * args.num_kv_heads * args.head_dim * elem
        full = -(-(args.prompt_len + 8) // args.block_size) * args.num_layers * per_layer_block
        groups = worker.kv_groups
        llm.engine.close()
        return {
            "prompt_len": args.prompt_len, "layers": args.num_layers, "window": args.window,
            "kv_groups": [("full" if w is None else w) for w in groups.windows],
            "group_size": groups.group_size, "block_bytes": block,
            "peak_blocks": max(held), "end_blocks": held[-1],
            "peak_bytes": max(held) * block, "end_bytes": held[-1] * block,
            "full_attention_cache_bytes": full,
            "peak_over_full": max(held) * block / full, "end_over_full": held[-1] * block / full,
        }


def main(args: argparse.Namespace) -> None:
    if not args.gguf and not args.kv_window:
        raise SystemExit("give --gguf FILE and/or --kv-window")
    report: dict[str, Any] = {"cpu": cpu_model()}
    if args.gguf:
        report["gguf"] = r = gguf_memory(args.gguf)
        print(f"{Path(r['gguf']).name} ({r['quant']}): tensors in the file "
              f"{r['gguf_tensor_bytes'] / 2**20:.1f} MiB; weights held "
              f"{r['weights_tensor_bytes'] / 2**20:.1f} MiB ({r['weights_over_file']:.3f}x); "
              f"private resident growth less the KV cache {r['rss_growth_less_kv'] / 2**20:.1f} MiB "
              f"({r['rss_over_file']:.3f}x)")
    if args.kv_window:
        report["kv_window"] = r = kv_window_memory(args)
        print(f"one {r['prompt_len']}-token request, {r['layers']} layers, window "
              f"{r['window']}, groups {r['kv_groups']}: KV held at its peak "
              f"{r['peak_bytes'] / 2**20:.1f} MiB, at its end {r['end_bytes'] / 2**20:.1f} MiB; "
              f"a full-attention cache {r['full_attention_cache_bytes'] / 2**20:.1f} MiB "
              f"(peak {r['peak_over_full']:.3f}x, end {r['end_over_full']:.3f}x)")
    if args.output_json:
        save_report(args.output_json, report)
    else:
        print(json.dumps(report, indent=1, default=str))
