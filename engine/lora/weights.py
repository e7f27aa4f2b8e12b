"""LoRA adapter weights laid out for the decoder's fused projections, and their use in a step.

The decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``. An adapter's
``A`` matrices of one fused projection are stacked (``[sum r, in]``) and its ``B``
matrices placed block-diagonally in ``[out, sum r]``, scaled by ``lora_alpha / r``, so a
projection's update is two matrix products whatever subset of q/k/v (gate/up) the adapter
targets: ``out += (x @ A.T) @ B.T``, as PEFT computes it (dropout is a training-time op).

A step may mix requests of several adapters and of none: :class:`LoRAStep` holds each
adapter's token rows, and applies each adapter to its rows only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.engine.errors import LoRAError
from pagedserve.engine.lora.request import (
    FUSED,
    WEIGHTS_FILE,
    LoRALimits,
    LoRARequest,
    check_adapter,
)


@dataclass(slots=True)
class LoRAWeights:
    request: LoRARequest
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    """Per layer: a fused projection's ``(A [sum r, in], scaled B [out, sum r])``."""


def load_lora(req: LoRARequest, limits: LoRALimits, dtype: torch.dtype,
              device: torch.device) -> LoRAWeights:  # fmt: skip
    """Check an adapter against the model (:func:`check_adapter`) and load its weights;
    a :class:`LoRAError` naming the adapter says why it cannot be loaded (whatever its
    files hold, or however they changed since it was checked)."""
    try:
        return _load(req, limits, dtype, device)
    except LoRAError as e:
        raise LoRAError(f"the LoRA adapter {req.lora_name!r} cannot be loaded: {e}") from None
    except Exception as e:  # noqa: BLE001 - a file swapped mid-read, a device out of memory
        raise LoRAError(f"the LoRA adapter {req.lora_name!r} cannot be loaded: "
                        f"{type(e).__name__}: {e}") from None


def _load(req: LoRARequest, limits: LoRALimits, dtype: torch.dtype,
          device: torch.device) -> LoRAWeights:  # fmt: skip
    from safetensors.torch import load_file

    cfg, found = check_adapter(req.lora_path, limits)
    path = Path(req.lora_path) / WEIGHTS_FILE
    try:
        tensors = load_file(str(path))
    except Exception as e:  # a truncated or foreign file
        raise LoRAError(f"{path} is not a readable safetensors file: {e}") from None
    weights = {}
    for (layer, module), names in found.items():
        out_f, in_f = limits.shape_of(module)
        for ab, name in names.items():
            want = (cfg.rank, in_f) if ab == "A" else (out_f, cfg.rank)
            t = tensors.get(name)
            if t is None or tuple(t.shape) != want:
                raise LoRAError(f"{path} changed while it was read: tensor {name!r} is "
                                f"{'gone' if t is None else tuple(t.shape)}, not {want}")
        weights[layer, module] = {ab: tensors[name] for ab, name in names.items()}
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for i in range(limits.num_layers):
        fused = {}
        for proj, modules in FUSED.items():
            ab = _fuse(i, modules, weights, limits, cfg.rank, cfg.scaling)
            if ab is not None:
                fused[proj] = (ab[0].to(device, dtype), ab[1].to(device, dtype))
        layers.append(fused)
    return LoRAWeights(req, layers)


def _fuse(layer: int, modules: Iterable[str], found, limits: LoRALimits, rank: int,
          scaling: float):  # fmt: skip
    """``(A, B)`` of one fused projection of a layer, or None when the adapter has none."""
    modules = tuple(modules)
    present = [m for m in modules if (layer, m) in found]
    if not present:
        return None
    out_total = sum(limits.shape_of(m)[0] for m in modules)
    a = torch.cat([found[(layer, m)]["A"].float() for m in present])
    b = torch.zeros(out_total, rank * len(present))
    row = col = 0
    for m in modules:
        if m in present:
            b[row:row + limits.shape_of(m)[0], col:col + rank] = \
                found[(layer, m)]["B"].float() * scaling  # fmt: skip
            col += rank
        row += limits.shape_of(m)[0]
    return a, b


class LoRARegistry:
    """The adapters loaded on a device: those of live requests (never evicted, so a step
    never loads one), and up to ``capacity`` in all, least recently used first out."""

    def __init__(self, limits: LoRALimits, dtype: torch.dtype, device: torch.device,
                 capacity: int) -> None:  # fmt: skip
        self.limits, self.dtype, self.device = limits, dtype, device
        self.capacity = capacity
        self._loaded: OrderedDict[int, LoRAWeights] = OrderedDict()
        self.in_use: Callable[[], set[int]] = set
        """The adapter ids of live requests (set by the engine)."""
        self._retired: set[int] = set()
        """Ids no longer served whose weights live requests still use."""

    def retire(self, lora_int_id: int) -> None:
        """The adapter of ``lora_int_id`` is no longer served (unloaded): its weights go
        now, or when the last live request that uses it ends."""
        if lora_int_id in self._loaded:
            self._retired.add(lora_int_id)
            self._drop_retired()

    def _drop_retired(self) -> None:
        used = self.in_use()
        for lid in [i for i in self._retired if i not in used]:
            self._retired.discard(lid)
            self._loaded.pop(lid, None)

    def get(self, req: LoRARequest) -> LoRAWeights:
        """The adapter's weights, loaded (and checked) on first use. An id that live
        requests use for another adapter is a :class:`LoRAError`."""
        lid = req.lora_int_id
        w = self._loaded.get(lid)
        if w is not None and w.request == req:
            self._loaded.move_to_end(lid)
            return w
        if w is not None and lid in self.in_use():
            raise LoRAError(f"lora_int_id={lid} is in use by adapter {w.request.lora_name!r} "
                            f"({w.request.lora_path}); another adapter needs another id")
        self._loaded.pop(lid, None)
        self._evict(self.capacity - 1)  # before the load: its memory can take their place
        w = self._loaded[lid] = load_lora(req, self.limits, self.dtype, self.device)
        return w

    def _evict(self, keep: int) -> None:
        """Drop least recently used adapters no live request uses until ``keep`` remain
        (or only used ones do)."""
        if len(self._loaded) <= keep:
            return
        used = self.in_use()
        for old in [k for k in self._loaded if k not in used]:  # least recent first
            if len(self._loaded) <= keep:
                break
            del self._loaded[old]
            self._retired.discard(old)

    @property
    def loaded_ids(self) -> list[int]:
        return list(self._loaded)

    def for_step(self, spans: Iterable[tuple[LoRARequest | None, int, int]],
                 num_tokens: int) -> LoRAStep | None:  # fmt: skip
        """The step's adapters from each request's ``(adapter, first row, end row)``;
        None when no row has one."""
        if self._retired:
            self._drop_retired()
        rows: dict[LoRARequest, list[int]] = {}
        for req, lo, hi in spans:
            if req is not None:
                rows.setdefault(req, []).extend(range(lo, hi))
        if not rows:
            return None
        return LoRAStep([(self.get(req), None if len(r) == num_tokens else
                          torch.tensor(r, dtype=torch.int64, device=self.device))
                         for req, r in rows.items()])  # fmt: skip


class LoRAStep:
    """The adapters of one step, each with its token rows (None: every row)."""

    __slots__ = ("groups",)

    def __init__(self, groups: list[tuple[LoRAWeights, torch.Tensor | None]]) -> None:
        self.groups = groups

    def apply(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the projection ``proj`` of ``x`` in layer ``layer``) plus each adapter's
        update on its rows; updates ``out`` in place."""
        for w, rows in self.groups:
            ab = w.layers[layer].get(proj)
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                out.addmm_(x @ a.t(), b.t())
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return out
