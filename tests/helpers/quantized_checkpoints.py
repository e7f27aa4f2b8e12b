"""GPTQ and AWQ checkpoints of a float model, packed as AutoGPTQ / AutoAWQ write them.

:func:`write_quantized` rounds each decoder projection of a float checkpoint to integer
codes per group (round to nearest, the scales in float16) and writes two folders: the
quantized checkpoint (``qweight``/``qzeros``/``scales``/``g_idx``, ``quantization_config``
in ``config.json``) and its reference, the same model with every projection's weight
replaced by ``scale * (code - zero)`` in float32, which HF transformers loads as a plain
model. The packing follows the two formats' definitions, written out here on their own:
GPTQ packs codes along the input dimension (the lowest bits first) and, in its original
``gptq`` format, stores zero points minus one; AWQ's GEMM layout packs 8 output columns
per int32 in the order 0, 2, 4, 6, 1, 3, 5, 7.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Scheme:
    method: str = "gptq"
    bits: int = 4
    group_size: int = 32
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    extra_bias: bool = False
    """Write an all-zero ``bias`` for every projection (as GPTQ tools do)."""
    unquantized: tuple[str, ...] = ()
    """Modules left in float (AWQ's ``modules_to_not_convert``)."""

    def config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "sym": self.sym, "desc_act": self.desc_act,
                "checkpoint_format": self.checkpoint_format}


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns of 32 bits as int32 (two's complement)."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[k, n]`` codes packed along k: int32 ``[k * bits / 32, n]``."""
    per = 32 // bits
    c = codes.to(torch.int64).view(-1, per, codes.shape[1])
    shifts = torch.arange(per, dtype=torch.int64)[None, :, None] * bits
    return _int32((c << shifts).sum(dim=1))


def _pack_columns(values: torch.Tensor, bits: int, order: tuple[int, ...] | None) -> torch.Tensor:
    """``[r, n]`` values packed along n: int32 ``[r, n * bits / 32]`` (field i of each
    int32 holds column ``order[i]`` of its run)."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    if order is not None:
        v = v[:, :, list(order)]
    shifts = torch.arange(per, dtype=torch.int64)[None, None, :] * bits
    return _int32((v << shifts).sum(dim=2))


def _quantize(w: torch.Tensor, s: Scheme, gen: torch.Generator):
    """Codes ``[n, k]``, zeros and float16 scales ``[groups, n]``, g_idx ``[k]``."""
    n, k = w.shape
    size = k if s.group_size == -1 else s.group_size
    groups = k // size
    if s.desc_act:  # each column's group from a random permutation (act-order)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // size).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // size).to(torch.int32)
    maxq = 2**s.bits - 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if s.sym:
            scales[g] = (2 * cols.abs().amax(dim=1) / maxq).clamp_min(1e-4)
            zeros[g] = (maxq + 1) // 2
        else:
            lo, hi = cols.amin(dim=1).clamp_max(0), cols.amax(dim=1).clamp_min(0)
            scales[g] = ((hi - lo) / maxq).clamp_min(1e-4)
            low_zero = 1 if s.checkpoint_format == "gptq" else 0  # v1 cannot store zero 0
            zeros[g] = torch.round(-lo / scales[g]).clamp(low_zero, maxq).to(torch.int64)
    scales = scales.half()
    sf, z = scales.float()[g_idx.long()].T, zeros[g_idx.long()].T
    codes = torch.clamp(torch.round(w / sf) + z, 0, maxq).to(torch.int64)
    return codes, zeros, scales, g_idx


def write_quantized(src: Path, out: Path, ref: Path, s: Scheme, seed: int = 0) -> None:
    """``out``: ``src`` quantized with scheme ``s``; ``ref``: its float32 reference."""
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.rpartition(".")[2] not in PROJECTIONS or leaf != "weight" \
                or prefix in s.unquantized:  # fmt: skip
            packed[name] = reference[name] = t
            continue
        codes, zeros, scales, g_idx = _quantize(t.float(), s, gen)
        reference[name] = (scales.float()[g_idx.long()].T * (codes - zeros[g_idx.long()].T)).float()
        packed[prefix + ".scales"] = scales
        if s.method == "awq":
            packed[prefix + ".qweight"] = _pack_columns(codes.T, 4, AWQ_ORDER)
            packed[prefix + ".qzeros"] = _pack_columns(zeros, 4, AWQ_ORDER)
        else:
            packed[prefix + ".qweight"] = _pack_rows(codes.T, s.bits)
            stored = zeros - (1 if s.checkpoint_format == "gptq" else 0)
            packed[prefix + ".qzeros"] = _pack_columns(stored, s.bits, None)
            packed[prefix + ".g_idx"] = g_idx
        if s.extra_bias and prefix + ".bias" not in tensors:
            packed[prefix + ".bias"] = torch.zeros(t.shape[0], dtype=torch.float16)
    for folder, weights in ((out, packed), (ref, reference)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors" and f.is_file():
                shutil.copy(f, folder / f.name)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = s.config()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
