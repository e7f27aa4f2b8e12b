"""Choosing the kernels by name and device: an attention backend and its layer ops.

:func:`select_kernels` picks the attention backend and the
:class:`~pagedserve.kernels.layer_ops.LayerOps` that run beside it as one choice (the native
attention kernel with the native layer ops of the same library, torch ops
everywhere else). The Triton backend is imported lazily, only when chosen, so the CPU
path never imports triton. The caller's :class:`~pagedserve.kernels.settings.KernelSettings` say
what ``"auto"`` stands for and how to build the native library; nothing here reads the
environment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import native
from pagedserve.kernels.interface import AttentionBackend
from pagedserve.kernels.layer_ops import LayerOps, TorchLayerOps
from pagedserve.kernels.settings import KernelSettings

BACKENDS = ("auto", "cpu", "torch", "triton")


@dataclass(frozen=True, slots=True)
class Kernels:
    """The kernels a model runs with: attention and the layer ops, chosen together."""

    attention: AttentionBackend
    ops: LayerOps


def select_kernels(
    name: str = "auto", device: str | torch.device = "cpu",
    settings: KernelSettings | None = None,
) -> Kernels:
    """The attention backend ``name`` for ``device`` and its layer ops.

    ``"auto"`` (``settings.auto_backend`` may name a backend instead: the engine's
    ``PAGEDSERVE_ATTENTION_BACKEND``) picks Triton on CUDA; on the CPU the native backend
    (``"cpu"``: C kernels built at first use, with the native layer ops) or, when those
    cannot be built, pure torch. Triton on a non-CUDA device needs the interpreter
    (``settings.triton_interpret``: ``TRITON_INTERPRET=1``; exact but slow, for tests).
    """
    settings = settings or KernelSettings()
    if name == "auto":
        name = settings.auto_backend.strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
    device_type = torch.device(device).type
    if name == "auto":
        if device_type == "cuda":
            name = "triton"
        elif device_type == "cpu" and native.load(settings) is not None:
            name = "cpu"
        else:
            name = "torch"
    if name == "cpu":
        if device_type != "cpu":
            raise RuntimeError(f"the cpu attention backend runs on the CPU (got {device_type!r})")
        lib = native.load(settings)
        if lib is None:
            raise RuntimeError("the cpu attention backend's native kernel is unavailable: "
                               f"{native.unavailable_reason(settings)}")  # fmt: skip
        from pagedserve.kernels.cpu.backend import CpuBackend
        from pagedserve.kernels.cpu.layer_ops import NativeLayerOps

        ops: LayerOps = NativeLayerOps(lib, settings.pack_weights, settings.quantized_activations,
                                       settings.int8_dots)
        return Kernels(CpuBackend(lib, ops, settings.fuse_layers), ops)
    ops = TorchLayerOps()
    if name == "torch":
        from pagedserve.kernels.torch_backend import TorchBackend

        return Kernels(TorchBackend(ops), ops)
    if device_type != "cuda" and not settings.triton_interpret:
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device (got {device_type!r}); "
            "set TRITON_INTERPRET=1 before importing triton to run it interpreted on CPU"
        )
    try:
        import triton.language as tl

        from pagedserve.kernels.triton.backend import TritonBackend, TritonLayerOps
    except ImportError as exc:
        raise RuntimeError(
            "the triton attention backend needs the 'triton' package "
            "(pip install pagedserve[triton])"
        ) from exc
    # triton's own tl helpers are decorated when triton is imported: all or nothing.
    if device_type != "cuda" and type(tl.zeros).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "the triton kernels were compiled for a GPU: TRITON_INTERPRET=1 must be set "
            "before triton and pagedserve.kernels.triton are first imported"
        )
    ops = TritonLayerOps()
    return Kernels(TritonBackend(ops), ops)


def get_attention_backend(
    name: str = "auto", device: str | torch.device = "cpu",
    settings: KernelSettings | None = None,
) -> AttentionBackend:
    """The attention backend of :func:`select_kernels` (its ``ops`` are the layer ops
    chosen with it)."""
    return select_kernels(name, device, settings).attention
