"""Which CPU code paths this host gets, and why: one report for logs, benchmarks and tests.

Tests ask :func:`describe` which path the code chose instead of assuming the host's
instruction set; the engine logs :func:`summary` once at start-up and the throughput
benchmark prints it in its header and JSON.
"""

from __future__ import annotations

import platform

import torch

from pagedserve.kernels.cpu import native
from pagedserve.kernels.cpu.layer_ops import NativeLayerOps
from pagedserve.kernels.interface import AttentionBackend

# CPU flags worth naming in a report (x86 and aarch64 spellings as Linux reports them).
_REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16",
             "amx_tile", "asimd", "bf16", "sve")  # fmt: skip
# Flags of CPUs that compute in bfloat16 natively (AVX512-BF16 dot products, AMX tiles,
# the Armv8.6 BF16 extension).
_NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")


def native_bf16(features: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes in bfloat16 itself (AVX512-BF16, AMX-BF16 or Arm BF16);
    elsewhere bfloat16 arithmetic is converted to float32 and back."""
    have = native.cpu_features() if features is None else features
    return any(flag in have for flag in _NATIVE_BF16)


def describe(backend: AttentionBackend | None = None,
             dtype: torch.dtype = torch.float32) -> dict[str, object]:
    """The CPU's relevant features and the path each op takes with ``backend`` (default:
    the backend ``"auto"`` picks on the CPU) and activations of ``dtype``.

    Keys: ``cpu`` (machine), ``features``, ``native_bf16``, ``levels`` (native build
    levels this CPU runs), ``attention``, ``layer_ops``, ``linear_f32``, ``linear_bf16``,
    ``linear_quant`` (weight-only quantized linears), ``quant_activations`` (``int8`` or
    ``float``: how those take their activations), ``int8_dots`` (``vnni512``, ``vnni``,
    ``maddubs`` or ``none``: the integer dots of those 8-bit products), ``layers``
    (``fused``: a decode step's decoder layers run in one native call where its linears
    all run natively and its activations are float32; ``per-op``: one call per op).
    """
    if backend is None:
        from pagedserve.kernels.registry import get_attention_backend

        backend = get_attention_backend("auto", "cpu")
    feats = native.cpu_features()
    info: dict[str, object] = {
        "cpu": platform.machine(),
        "features": [f for f in _REPORTED if f in feats],
        "native_bf16": native_bf16(feats),
        "levels": list(native.runnable_levels()),
    }
    ops = backend.ops
    if isinstance(ops, NativeLayerOps):
        info["attention"] = ops.isa if backend.name == "cpu" else backend.name
        info.update(ops.paths())
        if not getattr(backend, "fuses_layers", False):
            info["layers"] = "per-op"
        elif dtype == torch.float32:
            info["layers"] = "fused"
        else:  # the fused call takes float32 activations only
            info["layers"] = f"per-op ({str(dtype).removeprefix('torch.')})"
    else:
        info.update(attention=backend.name, layer_ops="torch", linear_f32="torch",
                    linear_bf16="torch", linear_quant="torch (dequantized per call)",
                    quant_activations="float", int8_dots="none", layers="per-op")  # fmt: skip
    return info


def summary(info: dict[str, object], dtype: str, quantization: str | None = None) -> str:
    """One log line: ``cpu kernels: attention avx2, linear native-avx2 ..., layer ops avx2,
    layers fused; dtype float32 (no native bf16)``; with ``quantization`` the quantized
    linears' path."""
    linear = info["linear_bf16"] if dtype == "bfloat16" else info["linear_f32"]
    if quantization:
        linear = f"{quantization} {info['linear_quant']}"
    bf16 = "native bf16" if info["native_bf16"] else "no native bf16"
    return (f"cpu kernels: attention {info['attention']}, linear {linear}, layer ops "
            f"{info['layer_ops']}, layers {info['layers']}; dtype {dtype} ({bf16})")  # fmt: skip
