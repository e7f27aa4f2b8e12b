"""Every ``EngineConfig`` field as a command-line flag, generated from the dataclass.

Types come from the annotations (``int``, ``float``, ``str``, ``X | None``); booleans
become ``--x/--no-x``. Help text is the field's docstring in ``engine/config.py``
(read with ``ast``) after an entry of :data:`HELP`, else a generic line; the default
is always shown.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import types
import typing
from typing import Any

from pagedserve import EngineConfig

HELP: dict[str, str] = {
    "dtype": "Weights and activations dtype: auto, float32, float16 or bfloat16.",
    "kv_cache_dtype": "KV cache element type: auto (the model's dtype), float32, bfloat16, "
                      "float16 (CPU backends; on CUDA the model's dtype) or int8 (8-bit "
                      "codes and a scale per row; the native CPU backend).",
    "tokenizer": "Tokenizer folder or hub id (default: the model's).",
    "revision": "Hub revision (branch, tag or commit) of the model.",
    "max_model_len": "Context length (default: the model's max_position_embeddings, or "
                     "its sliding window or longrope original length where smaller).",
    "seed": "Seed of the engine's global random generator.",
    "block_size": "Tokens per KV cache block (8, 16, 32, 64 or 128).",
    "gpu_memory_utilization": "Fraction of GPU memory the engine may use (CUDA).",
    "num_gpu_blocks_override": "Exact number of KV cache blocks (overrides the memory budget).",
    "enable_prefix_caching": "Share full KV blocks between requests with a common prefix.",
    "kv_host_gb": "GiB of host memory for KV blocks evicted from the cache (off by default).",
    "kv_store_dir": "Folder of the on-disk KV block store (give its size too; off by default).",
    "kv_store_gb": "GiB of the on-disk KV block store (give its folder too).",
    "max_num_seqs": "Most sequences running at once.",
    "max_num_batched_tokens": "Token budget of one step (default: 2048 with chunked prefill).",
    "enable_chunked_prefill": "Split long prompts across steps.",
    "scheduling_policy": "fcfs (arrival order) or priority (by each request's priority, "
                         "lower first; a waiting request preempts less urgent running ones "
                         "when it finds no seat or blocks).",
    "device": "Device: auto, cpu or cuda.",
    "attention_backend": "Attention kernels: auto (cpu on the CPU when the native library "
                         "builds, else torch; triton on CUDA), cpu (the native library), torch "
                         "(the reference) or triton.",
    "quantization": "Weight-only quantized linears: gguf, int8, gptq or awq (default: none, but a GPTQ/AWQ "
                    "checkpoint is served quantized either way, and a .gguf file on the CPU "
                    "in its own blocks as the field's text below says).",
    "quantized_activations": "auto, int8 or float.",
    "enforce_eager": "Disable CUDA graphs.",
    "tensor_parallel_size": "Tensor-parallel ranks: each holds its share of the heads, the MLP and the vocabulary (processes spawned by the engine, or started by torchrun).",
    "speculative_config": "Speculative decoding as a JSON object, e.g. '{\"method\": "
                          "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": "
                          "4, \"prompt_lookup_min\": 2}' (default: off).",
}


def _field_docs() -> dict[str, str]:
    """Docstrings written under the fields of ``EngineConfig``."""
    docs: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(EngineConfig))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp: Any) -> tuple[type, bool]:
    """``(scalar type, optional)`` of an annotation such as ``int | None``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return non_none[0], True
        return str, True
    return tp, False


def _optional(conv: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null") else conv(text)

    parse.__name__ = conv.__name__
    return parse


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name in EngineConfig.field_names()]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ``EngineConfig`` field (dest = the field name)."""
    hints = typing.get_type_hints(EngineConfig)
    docs = _field_docs()
    group = parser.add_argument_group("engine", "EngineConfig fields")
    for f in engine_fields():
        tp, optional = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        text = " ".join(t for t in (HELP.get(f.name), docs.get(f.name)) if t) \
            or f"EngineConfig.{f.name}."
        flag = "--" + f.name.replace("_", "-")
        # The default is always shown, once: help texts that describe it keep theirs.
        shown = "" if "(default:" in text else " (default: %(default)s)"
        if tp is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=f"{text}{shown}")
            continue
        conv = tp if tp in (int, float, str) else str
        metavar = conv.__name__.upper()
        group.add_argument(flag, dest=f.name, type=_optional(conv) if optional else conv,
                           default=default, metavar=metavar, help=f"{text}{shown}")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` named by the parsed flags (raises ValueError if invalid)."""
    return EngineConfig.from_kwargs(**{name: getattr(args, name)
                                       for name in EngineConfig.field_names()})
