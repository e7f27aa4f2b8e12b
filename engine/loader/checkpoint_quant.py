"""Weights of GPTQ and AWQ checkpoints, kept quantized (``quantization="gptq"`` / ``"awq"``).

A checkpoint made by AutoGPTQ/GPTQModel or AutoAWQ says so in ``config.json``'s
``quantization_config`` (older ones in a ``quantize_config.json`` or ``quant_config.json``
beside it); its linears are stored as packed integer codes (``qweight``),
per-group zero points (``qzeros``) and float16 scales (``scales``), a weight being
``scale * (code - zero)`` over groups of ``group_size`` input columns (GPTQ's ``g_idx``
gives each column's group; with act-order, ``desc_act``, the groups are not contiguous).
They load into the native formats of :mod:`pagedserve.kernels.quant` whenever that is exact or
nearly so, and nothing is expanded:

- 4 bits, symmetric (every zero point 8, GPTQ's default): ``q4_0``, exact.
- 4 bits with zero points (AWQ, GPTQ ``sym: false``): ``q4_1`` with offset
  ``-scale * zero``, rounded to float16 (at most half a float16 unit of that product;
  AWQ's own float16 kernels round every weight so).
- 8 bits, symmetric: ``q8_0``, exact.

Groups are split into the 32-weight blocks of those formats (a group size that is a
multiple of 32, or one group per row). An act-order weight is stored with its columns
sorted by group, and its projection takes its input in that order
(:meth:`pagedserve.engine.models.decoder.DecoderForCausalLM.set_input_orders`); the parts of a
fused projection (q/k/v, gate/up) must then share one ``g_idx``, as GPTQ makes them
(they see the same input). Any other quantized linear (8 bits with zero points, 2 bits,
another group size, an lm_head, fused parts with different groups) is expanded to
float32 at load, exactly, and the start-up log says which and why. Layouts read here:
GPTQ's (codes packed along the input dimension, ``checkpoint_format`` ``gptq``, whose
zero points are stored minus one, or ``gptq_v2``) and AWQ's GEMM (codes packed along the
output dimension in the order 0, 2, 4, 6, 1, 3, 5, 7).

This module reads ``quantization_config``; :mod:`pagedserve.engine.loader.checkpoint_weights` the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.engine.errors import CheckpointQuantError
from pagedserve.engine.jsonlimits import read_json_object
from pagedserve.kernels.quant import QK

if TYPE_CHECKING:
    from pagedserve.engine.config import EngineConfig

CHECKPOINT_METHODS = ("gptq", "awq")
"""``quantization_config.quant_method`` values served (``quantization`` names them too)."""


QUANT_CONFIG_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
"""Where older AutoGPTQ / AutoAWQ checkpoints keep their settings (and the method each
file means), beside a ``config.json`` without ``quantization_config``."""


def read_quantization_config(hf_config: Any, model_path: Path | None) -> dict | None:
    """The checkpoint's quantization settings: ``config.json``'s ``quantization_config``,
    else one of :data:`QUANT_CONFIG_FILES` in ``model_path``; its key ``_source`` names
    where it came from (for error messages)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None:
        return {**(qc if isinstance(qc, dict) else qc.to_dict()), "_source": "quantization_config"}
    for name, method in QUANT_CONFIG_FILES.items():
        if model_path is not None and (model_path / name).is_file():
            qc = read_json_object(model_path / name, CheckpointQuantError)
            return {"quant_method": method, **qc, "_source": name}
    return None


def resolve_quantization(config: EngineConfig, qc: dict | None, model: str) -> str | None:
    """The quantization the engine serves ``model`` with: ``config.quantization``, or
    the checkpoint's own method (``qc``: :func:`read_quantization_config`) when it has
    one (which then rules out 16-bit ``dtype``s and tensor parallel, as an explicit one
    does)."""
    method = _checkpoint_method(config.quantization, qc, model)
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


def _checkpoint_method(requested: str | None, qc: dict | None, model: str) -> str | None:
    method = None if qc is None else qc.get("quant_method")
    if method is None:
        if requested in CHECKPOINT_METHODS:
            raise CheckpointQuantError(
                f"quantization={requested!r} needs a {requested.upper()} checkpoint "
                f"(config.json's quantization_config.quant_method {requested!r}), and "
                f"{model!r} has no quantization_config")
        return requested
    method = str(method).lower()
    if method not in CHECKPOINT_METHODS:
        raise CheckpointQuantError(
            f"{model!r} is quantized with {qc['_source']}.quant_method={method!r}, which is "
            f"not supported; supported checkpoint methods: {', '.join(CHECKPOINT_METHODS)} "
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
    source: str = "quantization_config"
    """Where the settings were read (named in error messages)."""

    @classmethod
    def from_config(cls, qc: dict) -> CheckpointQuant:
        """From :func:`read_quantization_config`'s settings of a GPTQ or AWQ checkpoint."""
        src = qc["_source"]
        method = str(qc.get("quant_method")).lower()
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size"))
        pack = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack != "int32":
            raise CheckpointQuantError(f"{src}.pack_dtype={qc['pack_dtype']!r}: codes packed in "
                                       "int32 are supported")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise CheckpointQuantError(
                    f"{src}.version={version!r}: only AWQ's 'gemm' layout is supported")
            if bits != 4:
                raise CheckpointQuantError(f"{src}.bits={bits!r}: AWQ checkpoints are read "
                                           "with 4 bits")
            sym, desc_act, minus_one = False, False, False  # zero points read, whatever they are
        else:
            if bits not in (2, 4, 8):
                raise CheckpointQuantError(f"{src}.bits={bits!r}: GPTQ checkpoints of 2, 4 or "
                                           "8 bits are supported")
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
                shown = "marlin (is_marlin_format)" if qc.get("is_marlin_format") else repr(fmt)
                raise CheckpointQuantError(f"{src}.checkpoint_format={shown}: 'gptq' or "
                                           "'gptq_v2' are supported")
            sym, desc_act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
            minus_one = fmt == "gptq"
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise CheckpointQuantError(f"{src}.group_size={group!r}: must be a positive "
                                       "number of columns or -1")
        return cls(method, bits, group, sym, desc_act, minus_one, src)

    @property
    def native_format(self) -> str | None:
        """The :data:`pagedserve.kernels.quant.FORMATS` name a linear of this checkpoint loads in
        (None: expanded to float32)."""
        if self.group_size != -1 and self.group_size % QK:
            return None
        if self.bits == 4:
            return "q4_0" if self.sym else "q4_1"
        return "q8_0" if self.bits == 8 and self.sym else None

    def describe(self) -> str:
        zeros = "symmetric" if self.sym else "zero points"
        group = "per row" if self.group_size == -1 else f"group {self.group_size}"
        act = ", act-order" if self.desc_act else ""
        return f"{self.method} {self.bits}-bit {zeros}, {group}{act}"
