"""A GPTQ or AWQ checkpoint's tensors, read into the native quantized formats.

What maps onto which format, and why, is in :mod:`pagedserve.engine.loader.checkpoint_quant`:
:func:`tensor_layout` decides it per decoder projection from the tensor names (and
``g_idx``) before loading; :func:`iter_checkpoint_weights` then unpacks each linear's
codes, zero points and scales and yields it as the model loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from pagedserve.engine.errors import CheckpointQuantError
from pagedserve.engine.loader.checkpoint_quant import CheckpointQuant
from pagedserve.engine.models.checkpoint_names import QUANTIZED_PARTS, layout_key, projection
from pagedserve.kernels.quant import QK, QuantizedWeight

if TYPE_CHECKING:
    from pagedserve.engine.models.spec import DecoderSpec

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ GEMM: the output column (within 8) that each 4-bit field of an int32 holds."""


def _tensor_files(path: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint at ``path`` and the file that holds it."""
    from pagedserve.engine.loader.model_files import weight_files

    names: dict[str, Path] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


@dataclass
class Layout:
    """How a checkpoint's quantized projections load (:func:`tensor_layout`)."""

    formats: dict[str, str]
    """``layers.{i}.{fused projection}`` -> its native format; absent: float32."""
    orders: dict[str, torch.Tensor]
    """``layers.{i}.{fused projection}`` -> the input column order its weight is stored
    in, where not the input's own (act-order: its columns sorted by group)."""
    unaligned: set[str]
    """Fused projections whose parts' groups do not line up (float32)."""
    with_g_idx: set[str]
    """The quantized modules that store a ``g_idx``."""


def tensor_layout(path: Path, quant: CheckpointQuant) -> Layout:
    """Per decoder projection, the native format it loads in and the column order of its
    weight: kept quantized when all its parts are stored quantized, the checkpoint's
    layout maps onto a native format, and its parts share one ``g_idx`` whose groups,
    sorted, are contiguous runs of the group size (see the module docstring)."""
    files = _tensor_files(path)
    parts: dict[str, list[str]] = {}
    for name in files:
        prefix, _, leaf = name.rpartition(".")
        key = layout_key(prefix + ".weight") if leaf in ("qweight", "weight") else None
        if key is not None and key.startswith("layers."):
            parts.setdefault(key, []).append(name)
    layout = Layout({}, {}, set(), {n.removesuffix(".g_idx") for n in files
                                    if n.endswith(".g_idx")})  # fmt: skip
    fmt = quant.native_format
    for key, names in parts.items():
        if fmt is None or not all(n.endswith(".qweight") for n in names):
            continue
        g_names = [n.removesuffix("qweight") + "g_idx" for n in names]
        if not any(g in files for g in g_names):
            layout.formats[key] = fmt
            continue
        order = _shared_order([_read(files, g) for g in g_names], quant.group_size)
        if order is None:
            layout.unaligned.add(key)
            continue
        layout.formats[key] = fmt
        if not torch.equal(order, torch.arange(order.numel())):
            layout.orders[key] = order
    return layout


def _read(files: dict[str, Path], name: str) -> torch.Tensor | None:
    if name not in files:
        return None
    with safe_open(str(files[name]), framework="pt", device="cpu") as f:
        return f.get_tensor(name)


def _shared_order(g_idx: list[torch.Tensor | None], group_size: int) -> torch.Tensor | None:
    """The column order that makes every part's groups contiguous runs of ``group_size``
    (None: the parts do not share one, or have none)."""
    first = g_idx[0]
    if first is None or any(g is None or not torch.equal(g, first) for g in g_idx):
        return None
    order = torch.argsort(first.long(), stable=True)
    return order if torch.equal(first.long()[order], _groups(first.numel(), group_size)) \
        else None  # fmt: skip


def _groups(k: int, group_size: int) -> torch.Tensor:
    """Each of ``k`` input columns' group when the groups run in order (int64)."""
    return torch.arange(k) // (k if group_size == -1 else group_size)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 ``packed``'s fields of ``bits`` bits, lowest first, as int32 codes spread
    along ``dim`` (0: each int32 holds consecutive rows; 1: consecutive columns)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == 0:
        codes = (p[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return codes.reshape(p.shape[0] * per, p.shape[1])
    codes = (p[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return codes.reshape(p.shape[0], p.shape[1] * per)


def _awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved columns (:data:`AWQ_ORDER`) put back in order."""
    rows, cols = codes.shape
    order = torch.tensor(AWQ_ORDER)
    out = torch.empty_like(codes).view(rows, cols // 8, 8)
    out[:, :, order] = codes.view(rows, cols // 8, 8)
    return out.view(rows, cols)


@dataclass
class _Linear:
    """One quantized linear as integers: codes ``[n, k]``, zero points and float32
    scales ``[n, groups]``, and each input column's group ``[k]``."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_of: torch.Tensor

    def dequantize(self, rows_per_chunk: int = 1024) -> torch.Tensor:
        """float32 ``[n, k]``: ``scale * (code - zero)``, exact (made in chunks of rows,
        so a large weight takes little more than its output)."""
        g = self.group_of.long()
        out = torch.empty(self.codes.shape, dtype=torch.float32)
        for r in range(0, out.shape[0], rows_per_chunk):
            rows = slice(r, r + rows_per_chunk)
            torch.mul(self.scales[rows][:, g], (self.codes[rows] - self.zeros[rows][:, g]),
                      out=out[rows])  # fmt: skip
        return out

    def in_order(self, group: int) -> bool:
        return bool(torch.equal(self.group_of.long(), _groups(self.codes.shape[1], group)))

    def reordered(self, order: torch.Tensor) -> _Linear:
        """The same weight with its input columns in ``order``."""
        return _Linear(self.codes[:, order].contiguous(), self.zeros, self.scales,
                       self.group_of[order])  # fmt: skip


def _decode(quant: CheckpointQuant, name: str, parts: dict[str, torch.Tensor]) -> _Linear:
    missing = [p for p in QUANTIZED_PARTS[:3] if p not in parts]
    if missing:
        raise CheckpointQuantError(f"checkpoint module {name!r} has {', '.join(sorted(parts))} "
                                   f"but no {', '.join(missing)}")
    for part in ("qweight", "qzeros"):
        if parts[part].dtype != torch.int32:
            raise CheckpointQuantError(f"checkpoint module {name!r}: {part} is "
                                       f"{parts[part].dtype}, not int32 (pack_dtype)")
    scales = parts["scales"].float()
    mask = (1 << quant.bits) - 1
    if quant.method == "awq":
        codes = _awq_columns(_unpack(parts["qweight"], 4, 1)).T
        zeros = _awq_columns(_unpack(parts["qzeros"], 4, 1))
    else:
        codes = _unpack(parts["qweight"], quant.bits, 0).T
        zeros = _unpack(parts["qzeros"], quant.bits, 1)
        if quant.zeros_minus_one:  # a zero point of 0 is stored as the field's all ones
            zeros = (zeros + 1) & mask
    n, k = codes.shape
    groups = scales.shape[0]
    if scales.shape[1] != n or zeros.shape != (groups, n):
        raise CheckpointQuantError(
            f"checkpoint module {name!r}: scales {tuple(scales.shape)} and qzeros "
            f"{tuple(parts['qzeros'].shape)} do not fit qweight {tuple(parts['qweight'].shape)}")
    in_order = _groups(k, quant.group_size)
    if groups != int(in_order[-1]) + 1:
        raise CheckpointQuantError(
            f"checkpoint module {name!r}: {groups} groups of scales for {k} input columns, "
            f"but {quant.source}.group_size={quant.group_size} makes {int(in_order[-1]) + 1}")
    group_of = (parts["g_idx"] if "g_idx" in parts else in_order).to(torch.int32)
    if group_of.shape != (k,) or int(group_of.min()) < 0 or int(group_of.max()) >= groups:
        raise CheckpointQuantError(f"checkpoint module {name!r}: g_idx does not give each of "
                                   f"its {k} input columns one of its {groups} groups")
    return _Linear(codes.contiguous(), zeros.T.contiguous(), scales.T.contiguous(), group_of)


def _native(fmt: str, name: str, lin: _Linear, source: str) -> QuantizedWeight:
    """``lin`` in ``fmt``, its groups (in order) cut into blocks of :data:`QK` columns."""
    n, k = lin.codes.shape
    block_group = lin.group_of[::QK].long()
    d = lin.scales[:, block_group]
    zeros = lin.zeros[:, block_group]
    w = QuantizedWeight.empty(fmt, n, k)
    w.d.copy_(d.half())
    if fmt == "q4_1":
        w.m.copy_((-d * zeros.float()).half())
        codes = lin.codes
    else:
        centre = 8 if fmt == "q4_0" else 0
        codes = lin.codes - zeros.repeat_interleave(QK, dim=1) + centre
        lo, hi = (0, 15) if fmt == "q4_0" else (-128, 127)
        if int(codes.min()) < lo or int(codes.max()) > hi:
            raise CheckpointQuantError(
                f"checkpoint module {name!r}: {source}.sym is true but its zero "
                "points are not the middle of the code range")
    if fmt == "q8_0":
        w.qs.copy_(codes.to(torch.int8))
    else:
        blocks = codes.to(torch.uint8).view(n, k // QK, 2, QK // 2)
        w.qs.copy_((blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2))
    return w


def iter_checkpoint_weights(path: Path, quant: CheckpointQuant, layout: Layout,
                            spec: DecoderSpec,
                            ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """``(hf_name, tensor)`` for every weight of the checkpoint at ``path``: quantized
    linears as ``{module}.weight``, a :class:`QuantizedWeight` where ``layout`` (see
    :func:`tensor_layout`) keeps them (its columns in the layout's order), else float32;
    other tensors as stored, less the (all-zero) biases of projections that ``spec`` has
    none for."""
    from pagedserve.engine.loader.model_files import iter_weights

    pending: dict[str, dict[str, torch.Tensor]] = {}
    expanded: dict[str, str] = {}
    """Module -> why it is expanded to float32."""
    for name, tensor in iter_weights(path):
        prefix, _, leaf = name.rpartition(".")
        proj = projection(prefix)
        router = prefix.endswith((".mlp.gate", ".block_sparse_moe.gate", ".shared_expert_gate"))
        if leaf == "bias" and (router or proj is not None and not spec.has_bias(proj)):
            if bool(tensor.any()):
                raise CheckpointQuantError(
                    f"checkpoint tensor {name!r}: a bias the model has none for (its config "
                    "gives this projection no bias), and not all zero")
            continue  # GPTQ writes an all-zero bias for every linear
        if leaf not in QUANTIZED_PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        needed = QUANTIZED_PARTS if prefix in layout.with_g_idx else QUANTIZED_PARTS[:3]
        if all(p in parts for p in needed):
            yield _weight(quant, layout, prefix, pending.pop(prefix), expanded)
    for prefix, parts in pending.items():  # incomplete: _decode names what is missing
        yield _weight(quant, layout, prefix, parts, expanded)
    for reason in sorted(set(expanded.values())):
        names = [m for m, r in expanded.items() if r == reason]
        logger.warning("%d quantized linears expanded to float32 (%s), e.g. %s",
                       len(names), reason, names[0])


def _weight(quant: CheckpointQuant, layout: Layout, prefix: str,
            parts: dict[str, torch.Tensor], expanded: dict[str, str]) -> tuple[str, Any]:
    name = prefix + ".weight"
    lin = _decode(quant, prefix, parts)
    key = layout_key(name)
    fmt = layout.formats.get(key) if key is not None else None
    if fmt is not None:
        if key in layout.orders:
            lin = lin.reordered(layout.orders[key])
        if not lin.in_order(quant.group_size):
            raise CheckpointQuantError(f"checkpoint module {prefix!r}: its g_idx differs from "
                                       "the one read when the model was laid out")
        return name, _native(fmt, prefix, lin, quant.source)
    if quant.native_format is None:
        expanded[prefix] = f"{quant.describe()}: no native format"
    elif key is None or not key.startswith("layers."):
        expanded[prefix] = "not a decoder layer's projection"
    elif key in layout.unaligned:
        expanded[prefix] = "the parts of its fused projection have different groups (g_idx)"
    else:
        expanded[prefix] = "a part of its fused projection is stored unquantized"
    return name, lin.dequantize()
