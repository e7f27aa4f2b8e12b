"""Weights read from a GGUF file as it stores them (``quantization="gguf"``).

Tensors in ``Q8_0``, ``Q4_0`` and ``Q4_1`` become :class:`~pagedserve.kernels.quant.QuantizedWeight`
planes (the bytes of the file, split into codes, scales and offsets; nothing is
expanded); ``Q5_0``, ``Q5_1`` and the K-quants ``Q4_K``, ``Q5_K``, ``Q6_K`` (what a
``Q4_K_M`` or ``Q5_K_M`` file holds) become one plane of the file's blocks as they are;
``F32``/``F16``/``BF16`` tensors load as they are; any other GGML type (``Q2_K``,
``Q3_K``, the I-quants, ...) is dequantized to float32 by the ``gguf`` package and runs
as a float weight, as does a fused projection (q/k/v, gate/up) with a part of such a
type; the load says so in one log line per GGML type. A fused projection whose parts
are of different kept types (a ``Q4_K_M`` file's ``Q6_K`` ``attn_v`` beside its ``Q4_K``
``attn_q``/``attn_k``) keeps each part in its own (a ``StackedWeight``). Names are mapped
to the Hugging Face checkpoint's, and the rows of Llama's
``attn_q``/``attn_k`` are put back in Hugging Face order (llama.cpp's converter
interleaves the two halves of each head for its RoPE), so the model loads these tensors
exactly as it loads a safetensors checkpoint.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagedserve.engine.loader.gguf_file import TensorInfo, read_header
from pagedserve.engine.lora.request import FUSED
from pagedserve.engine.models.checkpoint_names import layout_key, projection
from pagedserve.kernels.quant import BLOCK_BYTES, BLOCK_WEIGHTS, QK, QuantizedWeight

logger = logging.getLogger(__name__)

NATIVE_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1",
                "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}  # fmt: skip
"""GGML types kept quantized, and their :data:`pagedserve.kernels.quant.FORMATS` names."""
FLOAT_TYPES = ("F32", "F16", "BF16")
"""GGML types that load as float tensors as they are (not counted as expanded)."""
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, **BLOCK_BYTES}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
"""``general.architecture`` values this loader maps (Llama's q/k rows are permuted;
Gemma's norms are stored as ``1 + weight``, as its converter writes them)."""
GEMMA = ("gemma2", "gemma3")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
"""Gemma's layer norms: its ``ffn_norm`` is the norm before the MLP, and the attention's
and the MLP's outputs have norms of their own."""
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def _tensor_blocks(data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """Tensor ``t``'s bytes in the file's memory map ``data``: ``[rows, bytes a row]``
    (GGML order: a row is the first dimension's weights)."""
    return data[t.offset:t.offset + t.nbytes].reshape(math.prod(t.shape[1:]), -1)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face checkpoint name of a GGUF tensor of a model of GGUF architecture
    ``arch`` (None: not a model weight)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if arch in GEMMA else _LAYER_NAMES
    m = _BLK.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}"


def quantized_from_blocks(fmt: str, raw: np.ndarray, k: int) -> QuantizedWeight:
    """Split GGML blocks ``raw`` (uint8 ``[n, k / block weights * block bytes]``) into
    planes (the block formats: one plane, the blocks as they are)."""
    n = raw.shape[0]
    data = torch.from_numpy(np.array(raw, dtype=np.uint8))
    if fmt in BLOCK_BYTES:
        return QuantizedWeight(fmt, n, k, data.reshape(n, -1).contiguous(), None)
    blocks = data.view(n, k // QK, _BLOCK_BYTES[fmt])
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, k // QK)
    m = None
    if fmt == "q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).view(n, k // QK)
        qs = blocks[..., 4:].reshape(n, k // 2)
    elif fmt == "q4_0":
        qs = blocks[..., 2:].reshape(n, k // 2)
    else:
        qs = blocks[..., 2:].reshape(n, k).view(torch.int8)
    return QuantizedWeight(fmt, n, k, qs.contiguous(), d.contiguous(), m)


def _unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """For each Hugging Face row of a Llama q/k weight, the GGUF row that holds it."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _kept_format(name: str, type_name: str, k: int) -> str | None:
    """The format a GGUF tensor (its name, GGML type name and row length ``k``) of a kept
    type loads in (None: another type). Its rows must be whole blocks of that format (as
    GGML stores them): a tensor that is not is refused, naming it."""
    fmt = NATIVE_TYPES.get(type_name)
    if fmt is not None and k % BLOCK_WEIGHTS[fmt]:
        raise ValueError(f"GGUF tensor {name!r} ({type_name}): its rows of {k} "
                         f"weights are not whole blocks of {BLOCK_WEIGHTS[fmt]}")
    return fmt


def tensor_formats(path: Path) -> dict[str, str | tuple[str, ...]]:
    """Per model weight (``layers.{i}.{projection}``, ``embed_tokens``, ``lm_head``) the
    quantized format it loads in; weights that load as float are absent. A fused
    projection (q/k/v, gate/up) is quantized when all its parts are of kept types: in
    their one format, or, where they differ, in each part's (a tuple in row order: a
    :class:`~pagedserve.kernels.quant.StackedWeight`)."""
    parts: dict[str, dict[str, str | None]] = {}
    header = read_header(path)  # names, types and shapes: no need for the package's reader
    arch = header.fields.get("general.architecture")
    arch = arch if isinstance(arch, str) else "llama"
    for t in header.tensors:
        name = hf_name(t.name, arch)
        key = None if name is None else layout_key(name)
        if key is not None:
            parts.setdefault(key, {})[projection(name.rpartition(".")[0]) or key] = \
                _kept_format(t.name, t.type_name, int(t.shape[0]))  # fmt: skip
    formats: dict[str, str | tuple[str, ...]] = {}
    for key, by_part in parts.items():
        kinds = set(by_part.values())
        if None in kinds:
            continue
        order = FUSED.get(key.rpartition(".")[2], ())
        if len(kinds) == 1:
            formats[key] = kinds.pop()
        elif set(by_part) == set(order):
            formats[key] = tuple(by_part[p] for p in order)
    return formats


def _log_expanded(tensors: list[TensorInfo], arch: str, quantized_keys: set[str]) -> None:
    """One log line per quantized GGML type whose tensors (model weights) load expanded
    to float32: types the kernels do not take, and kept types that are a part of a fused
    projection with a part of such a type."""
    other: dict[str, list[str]] = {}
    mixed: dict[str, list[str]] = {}
    for t in tensors:
        name = hf_name(t.name, arch)
        type_name = t.type_name
        if name is None or type_name in FLOAT_TYPES:
            continue
        if type_name not in NATIVE_TYPES:
            other.setdefault(type_name, []).append(t.name)
        elif layout_key(name) not in quantized_keys:
            mixed.setdefault(type_name, []).append(t.name)
    for type_name, names in sorted(other.items()):
        logger.warning("GGUF: %d %s tensors expanded to float32 (the kernels keep %s), e.g. %s",
                       len(names), type_name, ", ".join(NATIVE_TYPES), names[0])  # fmt: skip
    for type_name, names in sorted(mixed.items()):
        logger.warning("GGUF: %d %s tensors expanded to float32: fused (q/k/v or gate/up) with "
                       "a part of a type expanded, e.g. %s", len(names), type_name, names[0])


def iter_gguf_weights(path: Path, num_heads: int, num_kv_heads: int,
                      formats: dict[str, str]) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """``(hf_name, tensor)`` for every model weight of the GGUF file at ``path``; weights
    whose key is in ``formats`` (see :func:`tensor_formats`) come quantized."""
    import gguf

    header = read_header(path)  # every count and offset checked against the file's size
    arch = header.fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture={arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")  # fmt: skip
    quantized_keys = set(formats)
    _log_expanded(header.tensors, arch, quantized_keys)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in header.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        type_name = t.type_name
        fmt = NATIVE_TYPES.get(type_name)
        k = int(t.shape[0])
        keep = fmt is not None and layout_key(name) in quantized_keys
        raw = _tensor_blocks(data, t)
        if keep:
            value: torch.Tensor | QuantizedWeight = quantized_from_blocks(fmt, raw, k)
        elif type_name in ("F32", "F16"):  # BF16: through the gguf package
            value = torch.from_numpy(np.array(raw.view(np.float32 if type_name == "F32" else np.float16))).float()
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            value = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy()).float()
        if isinstance(value, torch.Tensor):
            value = value.reshape([int(s) for s in reversed(t.shape)]) if value.dim() else value
        if arch in GEMMA and name.endswith("norm.weight"):
            value = value - 1.0  # the checkpoint's weight, as HF's GGUF reader takes it
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            index = _unpermute_index(value.shape[0], heads)
            value = value.select_rows(index) if isinstance(value, QuantizedWeight) \
                else value[index]  # fmt: skip
        yield name, value
