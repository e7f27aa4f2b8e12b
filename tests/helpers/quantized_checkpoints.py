"""GPTQ and AWQ checkpoints of a tiny float model and their float references.

:func:`write_quantized` writes two folders: the quantized checkpoint
(:mod:`loadtest.rtn_checkpoint`, packed as AutoGPTQ / AutoAWQ pack theirs) and its
reference, the same model with every quantized projection's weight replaced by the
float32 weight the engine holds (``scale * (code - zero)``, and for 4 bits with zero
points ``scale * code`` plus that offset rounded to float16, as ``q4_1`` keeps it),
which HF transformers loads as a plain model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from loadtest.rtn_checkpoint import Scheme, quantize_tensors, write_folder

__all__ = ["Scheme", "write_quantized"]


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
