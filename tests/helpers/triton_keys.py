"""Recording what Triton would compile: the specialization key of every kernel launch.

Compiled Triton keys its cache on the constexprs and, for each argument that is not
``do_not_specialize``, what it specializes on: for an integer whether it is 1 and
whether it is divisible by 16 (and whether it needs 64 bits), for a pointer its dtype and
whether its address is divisible by 16. The interpreter compiles nothing, so
:class:`LaunchKeys` computes those keys itself from each launch's arguments; a new key
after warm-up is a compile mid-serving on a GPU.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def launch_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """The specialization key of ``kernel[grid](*args, **kwargs)``."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    opts = getattr(kernel, "kwargs", None) or {}
    no_spec = set(opts.get("do_not_specialize") or ())
    no_align = set(opts.get("do_not_specialize_on_alignment") or ())
    values = dict(zip((p.name for p in params), args, strict=False)) | kwargs
    key: list[Any] = [kernel.fn.__name__]
    for i, p in enumerate(params):
        v = values[p.name]
        if "constexpr" in str(p.annotation):
            key.append((p.name, "constexpr", v))
        elif isinstance(v, torch.Tensor):
            aligned = None if {p.name, i} & no_align else v.data_ptr() % 16 == 0
            key.append((p.name, str(v.dtype), aligned))
        elif isinstance(v, bool):
            key.append((p.name, "i1"))
        elif isinstance(v, int):
            wide = not -(2**31) <= v < 2**31
            spec = None if {p.name, i} & no_spec else (v == 1, v % 16 == 0)
            key.append((p.name, "i64" if wide else "i32", spec))
        else:
            key.append((p.name, type(v).__name__))
    return tuple(key)


class LaunchKeys:
    """Records the key of every launch of the given interpreted kernels."""

    def __init__(self, kernels: list[Any]) -> None:
        self.keys: list[tuple] = []
        for kernel in kernels:
            self._wrap(kernel)

    def _wrap(self, kernel: Any) -> None:
        run = kernel.run

        def recording_run(*args, grid, warmup, **kwargs):
            self.keys.append(launch_key(kernel, args, kwargs))
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = recording_run

    def distinct(self, start: int = 0) -> set[tuple]:
        return set(self.keys[start:])


def triton_kernels() -> list[Any]:
    """Every ``@triton.jit`` kernel of :mod:`pagedserve.kernels.triton` launched from the host."""
    import importlib
    import pkgutil

    import pagedserve.kernels.triton as pkg

    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"pagedserve.kernels.triton.{info.name}")
        for name, obj in vars(mod).items():
            if name.startswith("_") and name.endswith("_kernel") and hasattr(obj, "fn"):
                found.append(obj)
    return found
