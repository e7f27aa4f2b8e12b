"""Linear layers whose weights stay quantized, and how a projection is applied and
loaded."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.engine.errors import CheckpointShapeError
from pagedserve.kernels.quant import QuantizedWeight, StackedWeight


class QuantLinear(nn.Module):
    """A linear layer whose weight stays quantized (``ops.linear`` multiplies it)."""

    def __init__(self, weight: QuantizedWeight | StackedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.input_order: torch.Tensor | None = None
        """Set when the weight's columns are stored in another order than its input's
        (act-order checkpoints): the product takes ``x[:, input_order]``."""

    @property
    def in_features(self) -> int:
        return self.weight.k

    @property
    def out_features(self) -> int:
        return self.weight.n


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized (``ops.embedding`` dequantizes the rows it reads)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.weight = weight


def project(proj: nn.Module, x: torch.Tensor, ops: Any) -> torch.Tensor:
    """``proj(x)`` through the backend's ``ops.linear``, the input gathered in the order
    of the weight's columns where a checkpoint stored them so (GPTQ act-order)."""
    order = getattr(proj, "input_order", None)
    return ops.linear(x if order is None else x.index_select(-1, order), proj.weight, proj.bias)


def put_rows(module: nn.Module, kind: str, offset: int, tensor: torch.Tensor | QuantizedWeight,
             name: str, rows: int | None = None) -> None:
    """Rows ``offset ..`` of ``module``'s weight or bias := the checkpoint tensor ``name``
    (``rows`` of them; None: the rest). A quantized tensor goes into a quantized weight of
    its format, or is dequantized into a float one. A float tensor of another shape is
    refused (:class:`CheckpointShapeError`, naming it and the shape the config gives)."""
    target = getattr(module, kind)
    if isinstance(target, StackedWeight):  # each part of its own format
        if not isinstance(tensor, QuantizedWeight):
            raise ValueError(f"a {target.fmt} weight was laid out but the checkpoint has "
                             f"{tensor.dtype}")  # fmt: skip
        target.copy_rows_(offset, tensor)
        return
    if isinstance(target, QuantizedWeight):
        if not isinstance(tensor, QuantizedWeight) or tensor.fmt != target.fmt:
            got = tensor.fmt if isinstance(tensor, QuantizedWeight) else str(tensor.dtype)
            raise ValueError(f"a {target.fmt} weight was laid out but the checkpoint has {got}")
        target.copy_rows_(offset, tensor)
        return
    if isinstance(tensor, QuantizedWeight):
        tensor = tensor.dequantize()
    check_shape(name, tensor, (target.shape[0] - offset if rows is None else rows,
                               *target.shape[1:]))  # fmt: skip
    target[offset: offset + tensor.shape[0]].copy_(tensor)


def check_shape(name: str, tensor: torch.Tensor, want) -> None:
    """A :class:`CheckpointShapeError` unless the checkpoint tensor ``name`` has shape
    ``want`` (the one the model's config gives it)."""
    if tuple(tensor.shape) != tuple(want):
        raise CheckpointShapeError(f"checkpoint tensor {name!r} has shape "
                                   f"{list(tensor.shape)}, but the model's config gives it "
                                   f"shape {list(want)}")
