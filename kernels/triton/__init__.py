"""The CUDA path: Triton kernels for the paged KV write and attention, and their backend.

:mod:`pagedserve.kernels.triton.write_kv` scatters a step's K/V into the cache,
:mod:`pagedserve.kernels.triton.decode` attends decode rows (split-KV), :mod:`pagedserve.kernels.triton.prefill`
attends prefill chunks, :mod:`pagedserve.kernels.triton.common` holds what they share, and
:mod:`pagedserve.kernels.triton.backend` runs them as an attention backend. Imported only when the
triton backend is chosen (:mod:`pagedserve.kernels.registry`), so the CPU path never imports
triton. ``import triton`` in these modules is the PyPI package: imports are absolute,
and this package is ``pagedserve.kernels.triton``, never a top-level ``triton``.
"""
