"""Choosing an attention backend by name and device.

The Triton backend is imported lazily, only when chosen, so the CPU path never
imports triton.
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_native
from kernels.interface import AttentionBackend

ENV_VAR = "PAGEDSERVE_ATTENTION_BACKEND"
BACKENDS = ("auto", "cpu", "torch", "triton")


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def get_attention_backend(
    name: str = "auto", device: str | torch.device = "cpu"
) -> AttentionBackend:
    """Return the attention backend ``name`` for ``device``.

    ``"auto"`` (overridable with ``PAGEDSERVE_ATTENTION_BACKEND``) picks Triton on
    CUDA; on the CPU the native backend (``"cpu"``: torch plus C kernels built at first
    use) or, when those cannot be built, pure torch. Triton on a non-CUDA device needs
    ``TRITON_INTERPRET=1`` (the interpreter: exact but slow, for tests).
    """
    if name == "auto":
        name = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
    device_type = torch.device(device).type
    if name == "auto":
        if device_type == "cuda":
            name = "triton"
        elif device_type == "cpu" and cpu_native.load() is not None:
            name = "cpu"
        else:
            name = "torch"
    if name == "cpu":
        if device_type != "cpu":
            raise RuntimeError(f"the cpu attention backend runs on the CPU (got {device_type!r})")
        lib = cpu_native.load()
        if lib is None:
            raise RuntimeError("the cpu attention backend's native kernel is unavailable: "
                               f"{cpu_native.unavailable_reason()}")  # fmt: skip
        from kernels.cpu_backend import CpuBackend

        return CpuBackend(lib)
    if name == "torch":
        from kernels.torch_backend import TorchBackend

        return TorchBackend()
    if device_type != "cuda" and not _triton_interpreted():
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device (got {device_type!r}); "
            "set TRITON_INTERPRET=1 before importing triton to run it interpreted on CPU"
        )
    try:
        import triton.language as tl

        from kernels.triton_backend import TritonBackend
    except ImportError as exc:
        raise RuntimeError(
            "the triton attention backend needs the 'triton' package "
            "(pip install pagedserve[triton])"
        ) from exc
    # triton's own tl helpers are decorated when triton is imported: all or nothing.
    if device_type != "cuda" and type(tl.zeros).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "the triton kernels were compiled for a GPU: TRITON_INTERPRET=1 must be set "
            "before triton and kernels.triton_* are first imported"
        )
    return TritonBackend()
