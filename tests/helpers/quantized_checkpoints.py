"""GPTQ and AWQ checkpoints of a tiny float model and their float references.

:func:`write_quantized` writes two folders: the quantized checkpoint
(:mod:`pagedserve.loadtest.rtn_checkpoint`, packed as AutoGPTQ / AutoAWQ pack theirs) and its
reference, the same model with every quantized projection's weight replaced by the
float32 weight the engine holds (``scale * (code - zero)``, and for 4 bits with zero
points ``scale * code`` plus that offset rounded to float16, as ``q4_1`` keeps it),
which HF transformers loads as a plain model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedserve.loadtest.rtn_checkpoint import Scheme, quantize_tensors, write_folder

__all__ = ["Scheme", "split_into_shards", "tied_copy", "write_quantized"]


def write_quantized(src: Path, out: Path, ref: Path, s: Scheme, seed: int = 0,
                    ) -> dict[str, torch.Tensor]:
    """``out``: ``src`` quantized with scheme ``s``; ``ref``: its float32 reference, as
    the engine holds the weights (4 bits with zero points: ``q4_1``'s float16 offsets).
    Returns the exact dequantized tensors (``scale * (code - zero)``)."""
    tensors = load_file(str(src / "model.safetensors"))
    packed, exact = quantize_tensors(tensors, s, seed)
    rounded = s.bits == 4 and not s.sym
    held = quantize_tensors(tensors, s, seed, float16_offsets=True)[1] if rounded else exact
    write_folder(src, out, packed, s.config())
    write_folder(src, ref, held, None)
    return exact


def tied_copy(src: Path, out: Path) -> Path:
    """``src`` with tied word embeddings: its ``lm_head`` dropped, the embedding table
    serving as the logits matrix."""
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop("lm_head.weight")
    write_folder(src, out, tensors, None)
    cfg = json.loads((out / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def split_into_shards(folder: Path, shards: int = 2) -> None:
    """``folder``'s ``model.safetensors`` as ``shards`` files and an index, the tensors
    dealt out in turn (so a quantized linear's parts land in different files)."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
