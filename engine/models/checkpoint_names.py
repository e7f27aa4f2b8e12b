"""Checkpoint tensor names and the model weights they load into."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from pagedserve.engine.lora.request import FUSED

if TYPE_CHECKING:
    import torch

    from pagedserve.engine.models.spec import DecoderSpec, MoESpec

_FUSED = {part: fused for fused, parts in FUSED.items() for part in parts}
PROJECTIONS = tuple(_FUSED)
"""A decoder layer's checkpoint projections, ``q_proj`` .. ``down_proj``."""
MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Mixtral's names for an expert's projections."""
QUANTIZED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
"""The tensors of a GPTQ or AWQ linear (``{module}.{part}``; ``g_idx``: GPTQ's, optional)."""


def layout_key(hf: str) -> str | None:
    """The :meth:`pagedserve.engine.models.decoder.DecoderForCausalLM.quantize_layout` key of a
    checkpoint weight (``layers.{i}.{fused projection}``; an expert's
    ``layers.{i}.moe.experts.{e}.{fused projection}`` or ``layers.{i}.moe.shared_expert.
    {fused projection}``; ``embed_tokens``, ``lm_head``), or None for a weight that is
    never quantized (norms, biases, routers)."""
    if hf == "model.embed_tokens.weight":
        return "embed_tokens"
    if hf == "lm_head.weight":
        return "lm_head"
    parts = hf.split(".")
    proj = projection(hf.rpartition(".")[0])
    if parts[-1] != "weight" or proj is None:
        return None
    if "experts" in parts:  # mlp.experts.E.gate_proj, block_sparse_moe.experts.E.w1
        expert = parts[parts.index("experts") + 1]
        return f"layers.{parts[2]}.moe.experts.{expert}.{_FUSED[proj]}"
    if "shared_expert" in parts:
        return f"layers.{parts[2]}.moe.shared_expert.{_FUSED[proj]}"
    return f"layers.{parts[2]}.{_FUSED[proj]}"


def projection(module: str) -> str | None:
    """The projection (``q_proj`` .. ``down_proj``) that the checkpoint module ``module``
    (a tensor's name less its leaf) is, in a layer, an expert or a shared expert; None
    for anything else (routers, norms)."""
    parts = module.split(".")
    leaf = parts[-1]
    if leaf in MIXTRAL_EXPERT and len(parts) > 2 and parts[-3] == "experts":
        return MIXTRAL_EXPERT[leaf]
    return leaf if leaf in _FUSED else None


def required_tensors(spec: DecoderSpec, tied: bool) -> set[str]:
    """The tensors (names without ``model.``) a checkpoint of ``spec`` must hold
    (``tied``: the logits read the embedding table, so no ``lm_head.weight``)."""
    required = {"embed_tokens.weight", "norm.weight"} | (set() if tied else {"lm_head.weight"})
    for i in range(spec.num_layers):
        pre = f"layers.{i}."
        required.update(pre + n for n in ("input_layernorm.weight",
                                          "post_attention_layernorm.weight"))
        if spec.gemma_norms:
            required.update(pre + n for n in ("pre_feedforward_layernorm.weight",
                                              "post_feedforward_layernorm.weight"))
        moe = spec.moe is not None and i in spec.moe.layers
        if moe:
            required.update(pre + n for n in moe_tensor_names(spec.moe))
        for sub, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                           ("mlp", () if moe else ("gate_proj", "up_proj", "down_proj"))):
            for p in projs:
                required.add(f"{pre}{sub}.{p}.weight")
                if spec.has_bias(p):
                    required.add(f"{pre}{sub}.{p}.bias")
        if spec.qk_norm:
            required.update(f"{pre}self_attn.{p}.weight" for p in ("q_norm", "k_norm"))
    return required


def moe_tensor_names(spec: MoESpec) -> list[str]:
    """The checkpoint tensors (after ``layers.N.``) of a layer with experts."""
    if spec.mixtral_names:
        return ["block_sparse_moe.gate.weight"] + [
            f"block_sparse_moe.experts.{e}.{w}.weight"
            for e in range(spec.num_experts) for w in MIXTRAL_EXPERT]  # fmt: skip
    names = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}.weight" for e in range(spec.num_experts)
                                   for p in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
    if spec.shared_intermediate_size:
        names += [f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        names.append("mlp.shared_expert_gate.weight")
    return names


def unfuse(weights: Iterable[tuple[str, torch.Tensor]],
           spec: DecoderSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with Phi-3's fused projections split into the names every other path
    reads: ``self_attn.qkv_proj`` into ``q_proj``, ``k_proj``, ``v_proj`` and
    ``mlp.gate_up_proj`` into ``gate_proj``, ``up_proj`` (views of the stored tensor)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    splits = {"self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
              "mlp.gate_up_proj": (("gate_proj", "up_proj"),
                                   (spec.intermediate_size, spec.intermediate_size))}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        fused = next((f for f in splits if module.endswith("." + f)), None)
        if fused is None:
            yield name, tensor
            continue
        parts, sizes = splits[fused]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the "
                             f"config's sizes give {sum(sizes)}")
        parent = module.rpartition(".")[0]  # ...layers.N.self_attn or ...layers.N.mlp
        for part, piece in zip(parts, tensor.split(sizes), strict=True):
            yield f"{parent}.{part}.{leaf}", piece
