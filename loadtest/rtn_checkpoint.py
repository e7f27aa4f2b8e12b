"""GPTQ- and AWQ-format checkpoints of a float model, by round-to-nearest, for benchmarks
and tests.

``python -m pagedserve.loadtest.rtn_checkpoint IN_DIR OUT_DIR --method gptq --bits 4 --group-size 128``
rounds every decoder projection (q/k/v/o, gate/up/down) of the float checkpoint in
``IN_DIR`` to integer codes per group of input columns (the scales in float16) and writes
``OUT_DIR`` as AutoGPTQ / AutoAWQ write theirs: ``qweight``/``qzeros``/``scales``
(``g_idx`` for GPTQ), ``quantization_config`` in ``config.json``, the other tensors and
files copied. No calibration: the weights are those of RTN, not of GPTQ's or AWQ's
search, so the file measures serving speed and memory, not a quantizer's quality. The
layouts, from the formats' definitions: GPTQ packs codes along the input dimension
(lowest bits first) and in its original ``gptq`` format stores zero points minus one,
wrapped to the field (``--checkpoint-format gptq_v2`` does not); AWQ's GEMM layout packs 8 output columns
per int32 in the order 0, 2, 4, 6, 1, 3, 5, 7.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.engine.loader.checkpoint_weights import AWQ_ORDER
from pagedserve.engine.models.checkpoint_names import layout_key, projection


@dataclass(frozen=True)
class Scheme:
    method: str = "gptq"
    bits: int = 4
    group_size: int = 128
    """Input columns per group; -1: one group per row."""
    sym: bool = True
    desc_act: bool = False
    """GPTQ act-order: each column's group from a random permutation (``g_idx``), one
    per layer input (the q/k/v projections share theirs, as do gate/up)."""
    shared_act_order: bool = True
    """False: a permutation of its own for every projection (not what GPTQ makes)."""
    checkpoint_format: str = "gptq"
    extra_bias: bool = False
    """Write an all-zero ``bias`` for every projection that has none (as GPTQ tools do)."""
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


def group_index(k: int, s: Scheme, gen: torch.Generator) -> torch.Tensor:
    """Each of ``k`` input columns' group (``g_idx``)."""
    size = k if s.group_size == -1 else s.group_size
    if k % size:
        raise ValueError(f"--group-size {s.group_size} does not divide a weight of {k} columns")
    g_idx = (torch.arange(k) // size).to(torch.int32)
    if not s.desc_act:
        return g_idx
    shuffled = torch.empty_like(g_idx)
    shuffled[torch.randperm(k, generator=gen)] = g_idx
    return shuffled


def quantize(w: torch.Tensor, s: Scheme, g_idx: torch.Tensor):
    """``w`` ``[n, k]`` rounded over the groups ``g_idx``: codes ``[n, k]``, zero points
    and float16 scales ``[groups, n]``."""
    n, k = w.shape
    size = k if s.group_size == -1 else s.group_size
    maxq = 2**s.bits - 1
    groups = k // size
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
            zeros[g] = torch.round(-lo / scales[g]).clamp(0, maxq).to(torch.int64)
    scales = scales.half()
    sf, z = scales.float()[g_idx.long()].T, zeros[g_idx.long()].T
    codes = torch.clamp(torch.round(w / sf) + z, 0, maxq).to(torch.int64)
    return codes, zeros, scales


def quantize_tensors(tensors: dict[str, torch.Tensor], s: Scheme, seed: int = 0,
                     float16_offsets: bool = False,
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The checkpoint's tensors with its projections quantized, and the same model with
    each quantized projection's weight as its codes give it back (``scale * (code -
    zero)``, float32), for a reference; with ``float16_offsets``, as the ``q4_1`` format
    holds it (``scale * code + float16(-scale * zero)``)."""
    gen = torch.Generator().manual_seed(seed)
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    g_idx_of: dict[str | None, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if projection(prefix) is None or leaf != "weight" \
                or prefix in s.unquantized:  # fmt: skip
            packed[name] = dequantized[name] = t
            continue
        share = layout_key(name) if s.shared_act_order else name
        if share not in g_idx_of:
            g_idx_of[share] = group_index(t.shape[1], s, gen)
        g_idx = g_idx_of[share]
        codes, zeros, scales = quantize(t.float(), s, g_idx)
        sf, z = scales.float()[g_idx.long()].T, zeros[g_idx.long()].T
        dequantized[name] = sf * codes + (-sf * z).half().float() if float16_offsets \
            else sf * (codes - z)  # fmt: skip
        packed[prefix + ".scales"] = scales
        if s.method == "awq":
            packed[prefix + ".qweight"] = _pack_columns(codes.T, 4, AWQ_ORDER)
            packed[prefix + ".qzeros"] = _pack_columns(zeros, 4, AWQ_ORDER)
        else:
            packed[prefix + ".qweight"] = _pack_rows(codes.T, s.bits)
            # GPTQ's original format stores zero - 1 in the field (0 as all ones)
            stored = (zeros - 1) & (2**s.bits - 1) if s.checkpoint_format == "gptq" else zeros
            packed[prefix + ".qzeros"] = _pack_columns(stored, s.bits, None)
            packed[prefix + ".g_idx"] = g_idx.clone()
        if s.extra_bias and prefix + ".bias" not in tensors:
            packed[prefix + ".bias"] = torch.zeros(t.shape[0], dtype=torch.float16)
    return packed, dequantized


def write_folder(src: Path, out: Path, tensors: dict[str, torch.Tensor],
                 quantization_config: dict | None) -> None:
    """``out``: ``src``'s files (config, tokenizer) with ``tensors`` as its weights."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":  # fmt: skip
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    if quantization_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main(argv: list[str] | None = None) -> int:
    from pagedserve.engine.loader import iter_weights, resolve_model_path

    p = argparse.ArgumentParser(prog="python -m pagedserve.loadtest.rtn_checkpoint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a float checkpoint folder (or 'default': the embedded model)")
    p.add_argument("out", type=Path)
    p.add_argument("--method", choices=("gptq", "awq"), default="gptq")
    p.add_argument("--bits", type=int, choices=(2, 4, 8), default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true", help="zero points per group (AWQ: always)")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order g_idx")
    p.add_argument("--checkpoint-format", choices=("gptq", "gptq_v2"), default="gptq")
    args = p.parse_args(argv)
    if args.method == "awq" and args.bits != 4:
        p.error("--bits: AWQ checkpoints are 4-bit")
    src = resolve_model_path(None if args.src == "default" else args.src)
    scheme = Scheme(method=args.method, bits=args.bits, group_size=args.group_size,
                    sym=args.method == "gptq" and not args.asym, desc_act=args.desc_act,
                    checkpoint_format=args.checkpoint_format)
    try:
        packed, _ = quantize_tensors(dict(iter_weights(src)), scheme)
    except ValueError as exc:
        p.error(str(exc))
    write_folder(src, args.out, packed, scheme.config())
    print(f"wrote {args.out} ({scheme.config()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
