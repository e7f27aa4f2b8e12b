"""What the caller tells the kernels: the kernels read no environment variable.

The engine fills a :class:`KernelSettings` from its switches (``PAGEDSERVE_*``, ``CC``,
``TRITON_INTERPRET``; see :mod:`pagedserve.engine.worker.kernel_settings`); kernels used on their own
(tests, benchmarks) take the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def default_cache_dir() -> Path:
    """Where built native libraries go by default: ``~/.cache/pagedserve/kernels``."""
    return Path.home() / ".cache" / "pagedserve" / "kernels"


@dataclass(frozen=True, slots=True)
class KernelSettings:
    """The kernels' settings (see the module docstring)."""

    auto_backend: str = "auto"
    """The attention backend ``"auto"`` stands for: ``"auto"`` (chosen by device),
    ``"cpu"``, ``"torch"`` or ``"triton"`` (the engine's ``PAGEDSERVE_ATTENTION_BACKEND``)."""
    cpu_isa: str | None = None
    """The native CPU build level to use instead of the best this CPU runs
    (``PAGEDSERVE_CPU_ISA``)."""
    cache_dir: Path | None = None
    """Where built native libraries are kept; None: :func:`default_cache_dir`."""
    cc: str | None = None
    """The C compiler; None: ``cc``, else ``gcc``, on the ``PATH``."""
    pack_weights: bool = True
    """Whether the native layer ops keep packed copies of the linear weights
    (``PAGEDSERVE_PACK_WEIGHTS``)."""
    fuse_layers: bool = True
    """Whether the CPU backend runs a step's decoder layers in one native call where the
    step allows it (``PAGEDSERVE_FUSE_LAYERS``)."""
    quantized_activations: str = "auto"
    """How the CPU's quantized linears take activations: ``"int8"`` (8-bit, integer dot
    products, for the formats that have such a product), ``"float"`` or ``"auto"`` (int8
    on the vector builds); the engine's ``quantized_activations``."""
    int8_dots: str = "auto"
    """The integer dots of those 8-bit products: ``"vnni512"``, ``"vnni"``, ``"maddubs"``
    or ``"auto"`` (the widest VNNI the build and the CPU have; ``PAGEDSERVE_INT8_DOTS``)."""
    triton_interpret: bool = False
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET``), which the triton
    backend needs off CUDA."""

    @property
    def kernel_dir(self) -> Path:
        """:attr:`cache_dir`, or the default."""
        return self.cache_dir if self.cache_dir is not None else default_cache_dir()
