"""Perplexity and agreement: ``pagedserve bench perplexity``.

The text (``--text FILE``, or by default the docstrings of a fixed list of the standard
library's modules: a text every machine with this Python has, its digest printed so two
runs can be matched) is tokenized once and cut into chunks of ``--ctx`` tokens; each
chunk is one prompt scored with ``prompt_logprobs``, and, as llama.cpp's
``llama-perplexity`` does, only the second half of each chunk counts (every scored token
has at least ``ctx / 2`` tokens of context). The perplexity is ``exp`` of the mean
negative logprob of the scored tokens.

Each entry of ``--activations`` (default ``int8,float``: the quantized linears'
8-bit and float32 activations) is a run of its own on the same tokens; the report gives
each run's perplexity and time, and for every run after the first its perplexity against
the first's and its token-level agreement with it: the share of scored positions whose
most likely token is the same. ``--kv-cache-dtypes`` crosses the runs with KV cache
element types in the same way. With ``--llama-perplexity PATH`` the same text goes
through llama.cpp's tool on the same file (``-c ctx``, the host's cores) and its final
estimate is printed beside them: the anchor (the two tokenizers may cut the text a few
tokens apart). A step takes 128 tokens (``--max-num-batched-tokens``): the quantized
products take 8-bit activations up to their row limit only (128 rows on AVX2 builds),
above which the dequantized weights multiply float32 activations; the report says when
a run's steps went over it.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedserve.loadtest.bench_common import (
    add_engine_args,
    apply_threads,
    engine_kwargs,
    environment_info,
    module_cli,
    print_header,
)

TEXT_MODULES = ("argparse", "asyncio.events", "asyncio.streams", "collections", "contextlib",
                "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
                "enum", "fractions", "functools", "heapq", "inspect", "ipaddress",
                "itertools", "json", "logging", "os", "pathlib", "pickle", "random", "re",
                "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap",
                "threading", "typing", "unittest.case", "urllib.parse", "uuid", "zipfile")  # fmt: skip
"""The modules whose docstrings make the default text (about 150k tokens of English and
code in the model's own tokenizer)."""

_LLAMA_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_LLAMA_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


def stdlib_text() -> str:
    """The docstrings of :data:`TEXT_MODULES`: each module's, then each public class's
    and function's (with its methods'), in name order, separated by blank lines."""
    import importlib

    parts: list[str] = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                parts.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for meth in sorted(vars(obj)):
                    fn = vars(obj)[meth]
                    if not meth.startswith("_") and inspect.isfunction(fn):
                        parts.append(inspect.getdoc(fn) or "")
    return "\n\n".join(p for p in parts if p.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench perplexity``."""
    w = parser.add_argument_group("text and runs")
    w.add_argument("--text", metavar="FILE", default=None,
                   help="the text to score (default: the standard library's docstrings)")
    w.add_argument("--ctx", type=int, default=512, help="tokens a chunk (default: 512)")
    w.add_argument("--max-chunks", type=int, default=None,
                   help="score only the first N chunks (default: all)")
    w.add_argument("--activations", default="int8,float",
                   help="quantized linears' activations, one run each, comma-separated: "
                        "int8, float, auto (default: int8,float)")
    w.add_argument("--kv-cache-dtypes", default=None,
                   help="KV cache element types crossed with --activations, comma-separated "
                        "(default: --kv-cache-dtype alone)")
    w.add_argument("--llama-perplexity", metavar="PATH", default=None,
                   help="llama.cpp's llama-perplexity: the same text and file through it")
    w.add_argument("--save-result", metavar="FILE.json", default=None)
    add_engine_args(parser)


def chunk_scores(entries: list, first: int) -> tuple[list[float], list[int]]:
    """The logprobs of a chunk's scored tokens (positions ``first + 1 ..``) and the most
    likely token at each of those positions (``entries``: ``prompt_logprobs``, ``None``
    first)."""
    scored = entries[first + 1:]
    return ([e.logprob for e in scored], [e.top[0].token_id if e.top else e.token_id for e in scored])


def run_llama_perplexity(binary: str, model: str, text_path: Path, ctx: int,
                         max_chunks: int | None) -> dict[str, Any]:
    """llama-perplexity on the same file and text: its final PPL and the time it took."""
    cmd = [binary, "-m", model, "-f", str(text_path), "-c", str(ctx), "-t", str(os.cpu_count() or 1)]
    if max_chunks:
        cmd += ["--chunks", str(max_chunks)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    output = done.stdout + done.stderr
    found = _LLAMA_PPL.search(output)
    if found is None:
        raise RuntimeError(f"llama-perplexity gave no final estimate (exit {done.returncode}): "
                           f"{output[-2000:]}")
    chunks = _LLAMA_CHUNKS.search(output)
    return {"ppl": float(found[1]), "ppl_error": float(found[2]), "seconds": seconds,
            "chunks": int(chunks[1]) if chunks else None, "command": " ".join(cmd)}


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Score the text once per run; print and return the report."""
    from pagedserve import LLM, SamplingParams

    apply_threads(args)
    env = environment_info()
    text = Path(args.text).read_text(encoding="utf-8") if args.text else stdlib_text()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    if args.ctx < 4:
        raise SystemExit("--ctx must be at least 4")
    acts = [a.strip() for a in args.activations.split(",") if a.strip()]
    kvs = ([k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
           if args.kv_cache_dtypes else [args.kv_cache_dtype])
    runs = [(a, k) for k in kvs for a in acts]
    first = args.ctx // 2
    report: dict[str, Any] = {"environment": env, "text_sha256_16": digest, "ctx": args.ctx,
                              "runs": []}  # fmt: skip
    base_top: list[int] | None = None
    base_ppl: float | None = None
    chunks: list[list[int]] = []
    for i, (act, kv) in enumerate(runs):
        # 128 rows a step by default: within every format's row limit for the 8-bit
        # products (128 for Q5_K and Q6_K on AVX2 builds), above which the weights are
        # dequantized and the activations stay float32 whatever the setting.
        budget = args.max_num_batched_tokens or min(args.ctx, 128)
        llm = LLM(model=args.model, **engine_kwargs(args, quantized_activations=act, kv_cache_dtype=kv,
                                  enable_prefix_caching=False, max_num_batched_tokens=budget))
        worker = llm.engine.worker
        limit = getattr(getattr(worker.attn, "ops", None), "quant_max_rows", None)
        if i == 0:
            tokenizer = llm.get_tokenizer()
            ids = tokenizer.encode(text, add_special_tokens=False)
            # As llama-perplexity: a tokenizer that adds a BOS has it first, and in
            # place of each chunk's first token.
            bos = tokenizer.bos_token_id
            add_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
            if add_bos:
                ids = [bos, *ids]
            count = len(ids) // args.ctx
            if args.max_chunks:
                count = min(count, args.max_chunks)
            if count < 1:
                raise SystemExit(f"the text has {len(ids)} tokens: fewer than one chunk of {args.ctx}")
            chunks = [ids[c * args.ctx:(c + 1) * args.ctx] for c in range(count)]
            if add_bos:
                chunks = [[bos, *c[1:]] for c in chunks]
            report.update(tokens=len(ids), chunks=count, scored=count * (args.ctx - 1 - first),
                          bos=add_bos)
            print_header("pagedserve bench perplexity", env, {
                "model": f"{args.model or worker.settings.model_name} ({worker.quant_desc or 'float'})",
                "text": f"{args.text or 'standard library docstrings'} ({len(text)} chars, "
                        f"sha256 {digest}..., {len(ids)} tokens{', BOS first' if add_bos else ''})",
                "chunks": f"{count} x {args.ctx} tokens, the last {args.ctx - 1 - first} of "
                          f"each scored ({report['scored']} tokens)",
            })
        paths = worker.cpu_paths or {}
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                            SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
        seconds = time.perf_counter() - t0
        logprobs: list[float] = []
        top: list[int] = []
        for out in outs:
            lp, tp = chunk_scores(out.prompt_logprobs, first)
            logprobs += lp
            top += tp
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        entry: dict[str, Any] = {"activations": act, "kv_cache_dtype": kv,
                                 "quant_activations": paths.get("quant_activations"),
                                 "rows_per_step": budget, "quant_max_rows": limit,
                                 "ppl": ppl, "seconds": seconds,
                                 "kv_dtype": str(worker.kv_dtype).removeprefix("torch.")}
        if base_top is None:
            base_top, base_ppl = top, ppl
        else:
            entry["ppl_vs_first"] = ppl / base_ppl
            entry["agreement_vs_first"] = sum(a == b for a, b in zip(top, base_top, strict=True)) / len(top)
        report["runs"].append(entry)
        line = (f"activations {act:<5} (linears: {entry['quant_activations']}), KV {entry['kv_dtype']:<8} "
                f"PPL {ppl:9.4f}  in {seconds:7.1f} s")
        if "ppl_vs_first" in entry:
            line += (f"  vs the first run: PPL x{entry['ppl_vs_first']:.4f} "
                     f"({100 * (entry['ppl_vs_first'] - 1):+.2f}%), top-1 agreement "
                     f"{100 * entry['agreement_vs_first']:.2f}%")
        if entry["quant_activations"] == "int8" and limit is not None and budget > limit:
            line += f"  (steps over {limit} rows took float activations)"
        print(line)
        del llm
    if args.llama_perplexity:
        model = args.model or str(_default_gguf())
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
            f.write(text)
        try:
            lp = run_llama_perplexity(args.llama_perplexity, model, Path(f.name), args.ctx, args.max_chunks)
        finally:
            os.unlink(f.name)
        report["llama_perplexity"] = lp
        print(f"llama-perplexity (same file, text and ctx; {lp['chunks']} chunks): PPL {lp['ppl']:.4f} +/- "
              f"{lp['ppl_error']:.4f} in {lp['seconds']:.1f} s; the first run at "
              f"{100 * (report['runs'][0]['ppl'] / lp['ppl'] - 1):+.2f}% of it")
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(report, indent=2, default=str))
    return report


def _default_gguf() -> Path:
    from pagedserve.engine.loader import default_gguf_path

    return default_gguf_path()


if __name__ == "__main__":
    raise SystemExit(module_cli("python -m pagedserve.loadtest.perplexity_bench", __doc__,
                                add_arguments, main))
