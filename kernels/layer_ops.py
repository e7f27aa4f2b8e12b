"""The layer ops of a decoder: the :class:`LayerOps` protocol and its torch implementation.

Every op of a decoder layer other than attention goes through one ``LayerOps`` object,
chosen with the attention backend (:func:`pagedserve.kernels.registry.select_kernels`): the
norms (RMSNorm, and RMSNorm fused with the residual add), RoPE, SiLU-and-multiply,
the linear layers (whose weights it may prepare once at load), the embedding lookup
and greedy sampling's argmax. :class:`TorchLayerOps` is plain torch: the reference,
used on CUDA (where CUDA graphs capture it) and wherever the native library is
unavailable; :class:`pagedserve.kernels.cpu.layer_ops.NativeLayerOps` runs the same ops in the
native CPU library. So the model code is the same on every device.

The residual stream follows the usual fused form: ``add_rms_norm(residual, delta)``
returns ``(residual + delta, rms_norm(residual + delta))``; an implementation may
update ``residual`` in place, so callers must own it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.nn.functional as F

from pagedserve.kernels import quant
from pagedserve.kernels.quant import QuantizedWeight, StackedWeight


class LayerOps(Protocol):
    """The ops of a decoder layer besides attention (see the module docstring)."""

    name: str
    """What runs the ops: ``"torch"`` or ``"native"``."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * rmsnorm(x)`` over the last dim, ``x`` unchanged."""
        ...

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + delta, rms_norm(residual + delta))``; may update ``residual``."""
        ...

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` (cos/sin ``[T, 1, D]``);
        may work in place."""
        ...

    def prepare_weights(
        self, weights: Iterable[torch.Tensor | QuantizedWeight],
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        gated: Iterable[torch.Tensor | QuantizedWeight] = (),
    ) -> None:
        """Once at load: prepare the linear weights for :meth:`linear` (e.g. pack them),
        in memory from ``allocate(shape, dtype)`` where given (default ``torch.empty``);
        ``gated``: those of them that are MLP gate/up weights, for :meth:`gated_linear`."""
        ...

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for a float or a weight-only quantized weight."""
        ...

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        """Rows ``ids`` of the embedding table."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
        ...

    def gated_linear(
        self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None, gelu: bool,
    ) -> torch.Tensor:
        """An MLP's gated product: ``silu_mul`` (``gelu``: ``gelu_tanh_mul``) of
        ``linear(x, weight, bias)``, for a gate/up weight ``[2 * inter, k]`` (gate rows
        first); the same values, with or without the ``[rows, 2 * inter]`` product in
        between."""
        ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` for ``gate_up = [gate | up]`` (Gemma)."""
        ...

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of 2-D ``x`` (int64; the first maximum, NaN the largest)."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))``, computed in float32 as HF does."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(var + eps)).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x ``[T, H, D]``; cos/sin ``[T, 1, D]`` in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchLayerOps:
    """:class:`LayerOps` as torch expressions (the reference for every other implementation)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + delta
        return residual, rms_norm(residual, weight, eps)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k ``[T, Hkv, D]``; cos/sin ``[T, 1, D]`` in q's dtype."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def prepare_weights(
        self, weights: Iterable[torch.Tensor | QuantizedWeight],
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        gated: Iterable[torch.Tensor | QuantizedWeight] = (),
    ) -> None:
        """Once at load: prepare the linear weights for :meth:`linear` (nothing here)."""

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quant.linear_reference(x, weight, bias)
        if isinstance(weight, StackedWeight):
            return weight.linear(self.linear, x, bias)
        return F.linear(x, weight, bias)

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        """Rows ``ids`` of the embedding table (a quantized one dequantized to float32)."""
        if isinstance(weight, QuantizedWeight):
            return weight.dequantize(ids)
        return F.embedding(ids, weight)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` for ``gate_up = [gate | up]`` (Gemma)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def gated_linear(
        self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None, gelu: bool,
    ) -> torch.Tensor:
        """The product, then its gate (:meth:`silu_mul` or :meth:`gelu_tanh_mul`)."""
        gate_up = self.linear(x, weight, bias)
        return self.gelu_tanh_mul(gate_up) if gelu else self.silu_mul(gate_up)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of 2-D ``x`` (int64; the first maximum, NaN counting as
        the largest)."""
        return x.argmax(dim=-1)
