"""Sparse mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE).

Each token's router picks ``top_k`` experts; the step's tokens are grouped by expert so
each expert multiplies the rows routed to it in one product per projection, through the
backend's ``ops.linear`` (so every expert's weights are packed, quantized or sharded
like a dense MLP's). Numerics follow HF transformers: the router's softmax in float32,
each expert's output scaled by its weight, and a token's scaled outputs summed in
ascending expert order (as HF's loop over experts adds them), on every device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.engine.models.checkpoint_names import MIXTRAL_EXPERT
from pagedserve.engine.models.linear import project
from pagedserve.engine.models.spec import MoESpec
from pagedserve.kernels.interface import ExpertWeights


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one product."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        return project(self.down_proj, ops.silu_mul(project(self.gate_up_proj, x, ops)), ops)


class SparseMoE(nn.Module):
    """The experts of one layer, their router and (Qwen2-MoE) the shared expert."""

    def __init__(self, hidden_size: int, moe: MoESpec) -> None:
        super().__init__()
        self.spec = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        """The router: one logit per expert."""
        self.experts = nn.ModuleList(GatedMLP(hidden_size, moe.intermediate_size)
                                     for _ in range(moe.num_experts))  # fmt: skip
        shared = moe.shared_intermediate_size
        self.shared_expert = GatedMLP(hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor, ops: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts ``[T, top_k]`` (int64) and their weights ``[T, top_k]``
        (float32 for Mixtral, ``x``'s dtype for Qwen)."""
        logits = ops.linear(x, self.gate.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.spec.float32_weights else weights.to(x.dtype)

    def forward(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        experts, weights = self.route(x, ops)
        t, top_k = experts.shape
        experts, pos = experts.sort(dim=-1)  # each token's choices in ascending expert order
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        xs = x.index_select(0, order // top_k)
        ys, start = [], 0
        for expert, n in enumerate(counts):
            if n:
                ys.append(self.experts[expert].forward(xs[start:start + n], ops))
                start += n
        scaled = torch.cat(ys) * weights.gather(-1, pos).flatten()[order, None]
        per_choice = torch.empty_like(scaled).index_copy_(0, order, scaled).to(x.dtype)
        per_choice = per_choice.view(t, top_k, -1)
        out = per_choice[:, 0]  # summed in ascending expert order, as HF's loop adds them
        for j in range(1, top_k):
            out = out + per_choice[:, j]
        if self.shared_expert is not None:
            gate = torch.sigmoid(ops.linear(x, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert.forward(x, ops)
        return out

    def stack_weights(self) -> ExpertWeights:
        """The experts as a backend's ``run_layers`` takes them."""
        def order(proj: nn.Module) -> torch.Tensor | None:
            return getattr(proj, "input_order", None)

        shared = self.shared_expert
        return ExpertWeights(
            top_k=self.spec.top_k, norm_topk_prob=self.spec.norm_topk_prob,
            router=self.gate.weight, gate_up=tuple(e.gate_up_proj.weight for e in self.experts),
            down=tuple(e.down_proj.weight for e in self.experts),
            orders=tuple((order(e.gate_up_proj), order(e.down_proj)) for e in self.experts),
            shared_gate=None if shared is None else self.shared_expert_gate.weight,
            shared_gate_up=None if shared is None else shared.gate_up_proj.weight,
            shared_down=None if shared is None else shared.down_proj.weight,
            shared_orders=(None, None) if shared is None else
            (order(shared.gate_up_proj), order(shared.down_proj)))  # fmt: skip

    def expert_linears(self) -> Iterator[tuple[str, nn.Module]]:
        """``(name, module)`` of the experts' projections and the shared expert's (not the
        routers': they stay in the model's float dtype)."""
        mlps = [(f"experts.{i}", e) for i, e in enumerate(self.experts)]
        if self.shared_expert is not None:
            mlps.append(("shared_expert", self.shared_expert))
        for prefix, mlp in mlps:
            yield f"{prefix}.gate_up_proj", mlp.gate_up_proj
            yield f"{prefix}.down_proj", mlp.down_proj


def moe_tensor(moe: SparseMoE, leaf: list[str]) -> tuple[nn.Module, int] | None:
    """Where the checkpoint weight ``leaf`` (a layer's name after ``layers.N.``, split at
    dots) goes in ``moe``: ``(module, row offset)``; None if it is not one of the layer's
    expert or router weights (none of these modules has a bias)."""
    mixtral = moe.spec.mixtral_names
    if leaf[0] != ("block_sparse_moe" if mixtral else "mlp") or len(leaf) < 3 \
            or leaf[-1] != "weight":  # fmt: skip
        return None
    if leaf[1:] == ["gate", "weight"]:
        return moe.gate, 0
    if leaf[1:] == ["shared_expert_gate", "weight"] and moe.shared_expert_gate is not None:
        return moe.shared_expert_gate, 0
    if leaf[1] == "experts" and len(leaf) == 5 and leaf[2].isdigit() \
            and int(leaf[2]) < len(moe.experts):  # fmt: skip
        mlp = moe.experts[int(leaf[2])]
        # Mixtral names an expert's projections w1/w3/w2 (and only so)
        proj = MIXTRAL_EXPERT.get(leaf[3]) if mixtral else leaf[3]
    elif leaf[1] == "shared_expert" and len(leaf) == 4 and moe.shared_expert is not None:
        mlp, proj = moe.shared_expert, leaf[2]
    else:
        return None
    places = {"gate_proj": (mlp.gate_up_proj, 0),
              "up_proj": (mlp.gate_up_proj, mlp.down_proj.in_features),
              "down_proj": (mlp.down_proj, 0)}  # fmt: skip
    return places.get(proj)

