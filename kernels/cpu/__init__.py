"""The CPU path: native C kernels built at first use, and the backend that runs them.

:mod:`pagedserve.kernels.cpu.abi` reads the library's interface from ``csrc/abi.h`` (constants
and ctypes signatures, declared there once), :mod:`pagedserve.kernels.cpu.native` builds and
loads the library and wraps its attention kernel, :mod:`pagedserve.kernels.cpu.layer_ops` and
:mod:`pagedserve.kernels.cpu.quant` wrap its layer ops and quantized products,
:mod:`pagedserve.kernels.cpu.backend` is the ``cpu`` attention backend, :mod:`pagedserve.kernels.cpu.paths`
reports which path each op takes on this host, and :mod:`pagedserve.kernels.cpu.bench` is a
benchmark of the torch backend on the CPU.
"""
