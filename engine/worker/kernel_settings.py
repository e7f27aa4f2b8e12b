"""The kernels' settings, from the environment: the one place the engine hands its
switches (:mod:`pagedserve.engine.envs`) to :mod:`kernels`, which reads none itself."""

from __future__ import annotations

from pagedserve.engine import envs
from pagedserve.kernels.settings import KernelSettings


def kernel_settings(quantized_activations: str = "auto") -> KernelSettings:
    """``PAGEDSERVE_ATTENTION_BACKEND``, ``PAGEDSERVE_CPU_ISA``, ``$PAGEDSERVE_CACHE/kernels``,
    ``CC``, ``PAGEDSERVE_INT8_DOTS``, ``PAGEDSERVE_PACK_WEIGHTS``, ``PAGEDSERVE_FUSE_LAYERS`` and ``TRITON_INTERPRET`` as they are now,
    with the engine's ``quantized_activations``."""
    return KernelSettings(
        quantized_activations=quantized_activations,
        auto_backend=envs.attention_backend(),
        cpu_isa=envs.cpu_isa(),
        cache_dir=envs.cache_root() / "kernels",
        cc=envs.c_compiler(),
        int8_dots=envs.int8_dots(),
        pack_weights=envs.pack_weights(),
        fuse_layers=envs.fuse_layers(),
        triton_interpret=envs.triton_interpret(),
    )
