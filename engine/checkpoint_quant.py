"""Weights of GPTQ and AWQ checkpoints, kept quantized (``quantization="gptq"`` / ``"awq"``).

A checkpoint made by AutoGPTQ/GPTQModel or AutoAWQ says so in ``config.json``'s
``quantization_config``; its linears are stored as packed integer codes (``qweight``),
per-group zero points (``qzeros``) and float16 scales (``scales``), a weight being
``scale * (code - zero)`` over groups of ``group_size`` input columns (GPTQ's ``g_idx``
may list each column's group in another order: act-order). They load into the native
formats of :mod:`kernels.quant` whenever that is exact or nearly so, and nothing is
expanded:

- 4 bits, symmetric (every zero point 8, GPTQ's default): ``q4_0``, exact.
- 4 bits with zero points (AWQ, GPTQ ``sym: false``): ``q4_1`` with offset
  ``-scale * zero``, rounded to float16 (at most half a float16 unit of that product;
  AWQ's own float16 kernels round every weight so).
- 8 bits, symmetric: ``q8_0``, exact.

Groups are split into the 32-weight blocks of those formats (a group size that is a
multiple of 32, or one group per row). Any other quantized linear (act-order ``g_idx``,
8 bits with zero points, 2 bits, an lm_head) is expanded to float32 at load, exactly,
and the start-up log says which. Layouts read here: GPTQ's (codes packed along the input
dimension, ``checkpoint_format`` ``gptq``, whose zero points are stored minus one, or
``gptq_v2``) and AWQ's GEMM (codes packed along the output dimension in the order
0, 2, 4, 6, 1, 3, 5, 7).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from engine.models.decoder import layout_key
from kernels.quant import QK, QuantizedWeight

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.models.spec import DecoderSpec

logger = logging.getLogger(__name__)

CHECKPOINT_METHODS = ("gptq", "awq")
"""``quantization_config.quant_method`` values served (``quantization`` names them too)."""
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ GEMM: the output column (within 8) that each 4-bit field of an int32 holds."""


class CheckpointQuantError(ValueError):
    """A quantized checkpoint this loader cannot serve; the message names the setting."""


def _qconfig(hf_config: Any) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def resolve_quantization(config: EngineConfig, hf_config: Any, model: str) -> str | None:
    """The quantization the engine serves ``model`` with: ``config.quantization``, or
    the checkpoint's own method when it has one (which then rules out 16-bit
    ``dtype``s and tensor parallel, as an explicit one does)."""
    method = _checkpoint_method(config.quantization, hf_config, model)
    if method in CHECKPOINT_METHODS:
        if config.dtype in ("float16", "bfloat16"):
            raise CheckpointQuantError(
                f"dtype={config.dtype!r}: {model!r} is a {method} checkpoint, whose linears "
                "compute in float32 (dtype auto or float32)")
        if config.tensor_parallel_size > 1:
            raise CheckpointQuantError(
                f"tensor_parallel_size={config.tensor_parallel_size}: {model!r} is a {method} "
                "checkpoint, served on one rank")
    return method


def _checkpoint_method(requested: str | None, hf_config: Any, model: str) -> str | None:
    qc = _qconfig(hf_config)
    method = None if qc is None else qc.get("quant_method")
    if method is None:
        if requested in CHECKPOINT_METHODS:
            raise CheckpointQuantError(
                f"quantization={requested!r} needs a {requested.upper()} checkpoint "
                f"(config.json's quantization_config.quant_method {requested!r}), and "
                f"{model!r} has no quantization_config")
        return requested
    if method not in CHECKPOINT_METHODS:
        raise CheckpointQuantError(
            f"{model!r} is quantized with quantization_config.quant_method={method!r}, "
            f"which is not supported; supported checkpoint methods: {', '.join(CHECKPOINT_METHODS)} "
            "(or serve a float checkpoint, optionally with quantization='int8')")
    if requested not in (None, method):
        raise CheckpointQuantError(
            f"quantization={requested!r}, but {model!r} is a {method} checkpoint: pass "
            f"quantization={method!r} or leave it unset")
    return method


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's ``quantization_config``, checked."""

    method: str
    bits: int
    group_size: int
    """Input columns per group; -1: one group per row."""
    sym: bool
    desc_act: bool
    zeros_minus_one: bool
    """GPTQ's original format: each zero point is stored minus one."""

    @classmethod
    def from_hf(cls, hf_config: Any) -> CheckpointQuant:
        qc = _qconfig(hf_config) or {}
        method = qc.get("quant_method")
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size"))
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise CheckpointQuantError(
                    f"quantization_config.version={version!r}: only AWQ's 'gemm' layout is "
                    "supported")
            if bits != 4:
                raise CheckpointQuantError(f"quantization_config.bits={bits!r}: AWQ checkpoints "
                                           "are read with 4 bits")
            sym, desc_act, minus_one = not qc.get("zero_point", True), False, False
        else:
            if bits not in (2, 4, 8):
                raise CheckpointQuantError(f"quantization_config.bits={bits!r}: GPTQ checkpoints "
                                           "of 2, 4 or 8 bits are supported")
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise CheckpointQuantError(
                    f"quantization_config.checkpoint_format={fmt!r}: 'gptq' or 'gptq_v2' "
                    "are supported")
            sym, desc_act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
            minus_one = fmt == "gptq"
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise CheckpointQuantError(f"quantization_config.group_size={group!r}: must be a "
                                       "positive number of columns or -1")
        return cls(method, bits, group, sym, desc_act, minus_one)

    @property
    def native_format(self) -> str | None:
        """The :data:`kernels.quant.FORMATS` name a linear of this checkpoint loads in
        (None: expanded to float32)."""
        if self.desc_act or (self.group_size != -1 and self.group_size % QK):
            return None
        if self.bits == 4:
            return "q4_0" if self.sym else "q4_1"
        return "q8_0" if self.bits == 8 and self.sym else None

    def describe(self) -> str:
        zeros = "symmetric" if self.sym else "zero points"
        group = "per row" if self.group_size == -1 else f"group {self.group_size}"
        act = ", act-order" if self.desc_act else ""
        return f"{self.method} {self.bits}-bit {zeros}, {group}{act}"


def _tensor_names(path: Path) -> list[str]:
    from engine.model_files import weight_files

    names: list[str] = []
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def tensor_formats(path: Path, quant: CheckpointQuant) -> dict[str, str]:
    """Per model weight (``layers.{i}.{fused projection}``) the native format it loads
    in: a fused projection is kept quantized when all its parts are stored quantized
    and the checkpoint's layout maps onto a native format (see the module docstring)."""
    fmt = quant.native_format
    parts: dict[str, set[bool]] = {}
    for name in _tensor_names(path):
        prefix, _, leaf = name.rpartition(".")
        if leaf not in ("qweight", "weight"):
            continue
        key = layout_key(prefix + ".weight")
        if key is not None and key.startswith("layers."):
            parts.setdefault(key, set()).add(leaf == "qweight")
    if fmt is None:
        return {}
    return {key: fmt for key, kinds in parts.items() if kinds == {True}}


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
    """AWQ's interleaved columns (:data:`_AWQ_ORDER`) put back in order."""
    rows, cols = codes.shape
    order = torch.tensor(_AWQ_ORDER)
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

    def dequantize(self) -> torch.Tensor:
        """float32 ``[n, k]``: ``scale * (code - zero)``, exact."""
        g = self.group_of.long()
        return self.scales[:, g] * (self.codes - self.zeros[:, g]).float()

    def in_order(self, group: int) -> bool:
        k = self.codes.shape[1]
        size = k if group == -1 else group
        return bool(torch.equal(self.group_of.long(), torch.arange(k) // size))


def _decode(quant: CheckpointQuant, name: str, parts: dict[str, torch.Tensor]) -> _Linear:
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
    if missing:
        raise CheckpointQuantError(f"checkpoint module {name!r} has qweight but no "
                                   f"{', '.join(missing)}")
    scales = parts["scales"].float()
    if quant.method == "awq":
        codes = _awq_columns(_unpack(parts["qweight"], 4, 1)).T
        zeros = _awq_columns(_unpack(parts["qzeros"], 4, 1))
    else:
        codes = _unpack(parts["qweight"], quant.bits, 0).T
        zeros = _unpack(parts["qzeros"], quant.bits, 1) + int(quant.zeros_minus_one)
    n, k = codes.shape
    groups = scales.shape[0]
    if scales.shape[1] != n or zeros.shape != (groups, n):
        raise CheckpointQuantError(
            f"checkpoint module {name!r}: scales {tuple(scales.shape)} and qzeros "
            f"{tuple(parts['qzeros'].shape)} do not fit qweight {tuple(parts['qweight'].shape)}")
    if "g_idx" in parts:
        group_of = parts["g_idx"].to(torch.int32)
    else:
        size = k if quant.group_size == -1 else quant.group_size
        group_of = (torch.arange(k) // size).to(torch.int32)
    if group_of.shape != (k,) or int(group_of.min()) < 0 or int(group_of.max()) >= groups:
        raise CheckpointQuantError(f"checkpoint module {name!r}: g_idx does not give each of "
                                   f"its {k} input columns one of its {groups} groups")
    return _Linear(codes.contiguous(), zeros.T.contiguous(), scales.T.contiguous(), group_of)


def _native(fmt: str, name: str, lin: _Linear) -> QuantizedWeight:
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
                f"checkpoint module {name!r}: quantization_config.sym is true but its zero "
                "points are not the middle of the code range")
    if fmt == "q8_0":
        w.qs.copy_(codes.to(torch.int8))
    else:
        blocks = codes.to(torch.uint8).view(n, k // QK, 2, QK // 2)
        w.qs.copy_((blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2))
    return w


def iter_checkpoint_weights(path: Path, quant: CheckpointQuant, formats: dict[str, str],
                            spec: DecoderSpec,
                            ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """``(hf_name, tensor)`` for every weight of the checkpoint at ``path``: quantized
    linears as ``{module}.weight``, a :class:`QuantizedWeight` where ``formats`` (see
    :func:`tensor_formats`) keeps them, else float32; other tensors as stored, less the
    biases of projections that ``spec`` has none for."""
    from engine.model_files import iter_weights

    pending: dict[str, dict[str, torch.Tensor]] = {}
    expanded: dict[str, str] = {}
    """Module -> why it is expanded to float32."""
    for name, tensor in iter_weights(path):
        prefix, _, leaf = name.rpartition(".")
        if leaf == "bias" and not _has_bias(spec, prefix):
            continue  # GPTQ writes a bias for every linear; the model has none there
        if leaf not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if not all(p in parts for p in _PARTS[:3]) or (quant.method == "gptq" and "g_idx" not in parts):
            continue
        yield _weight(quant, formats, prefix, pending.pop(prefix), expanded)
    for prefix, parts in pending.items():  # GPTQ modules stored without g_idx
        yield _weight(quant, formats, prefix, parts, expanded)
    for reason in sorted(set(expanded.values())):
        names = [m for m, r in expanded.items() if r == reason]
        logger.warning("%d quantized linears expanded to float32 (%s), e.g. %s",
                       len(names), reason, names[0])


def _has_bias(spec: DecoderSpec, module: str) -> bool:
    proj = module.rpartition(".")[2]
    if proj in ("q_proj", "k_proj", "v_proj"):
        return spec.qkv_bias
    if proj == "o_proj":
        return spec.o_bias
    if proj in ("gate_proj", "up_proj", "down_proj"):
        return spec.mlp_bias
    return True


def _weight(quant: CheckpointQuant, formats: dict[str, str], prefix: str,
            parts: dict[str, torch.Tensor], expanded: dict[str, str]) -> tuple[str, Any]:
    name = prefix + ".weight"
    lin = _decode(quant, prefix, parts)
    key = layout_key(name)
    fmt = formats.get(key) if key is not None else None
    if fmt is not None and lin.in_order(quant.group_size):
        return name, _native(fmt, prefix, lin)
    if fmt is not None:
        raise CheckpointQuantError(
            f"checkpoint module {prefix!r}: its g_idx lists groups out of order, but "
            "quantization_config.desc_act is false")
    if quant.native_format is None:
        expanded[prefix] = f"{quant.describe()}: no native format"
    elif key is None or not key.startswith("layers."):
        expanded[prefix] = "not a decoder layer's projection"
    else:
        expanded[prefix] = "a part of its fused projection is stored unquantized"
    return name, lin.dequantize()
