"""RoPE cos/sin tables, computed exactly as HF transformers computes them."""

from __future__ import annotations

import torch

from pagedserve.engine.models.spec import rope_type


def rope_tables(cfg, head_dim: int, max_len: int,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos/sin tables [max_len, head_dim] in float32, computed as HF transformers does
    (``layer_type``: the ``rope_parameters`` entry of that layer type, Gemma 3's
    ``sliding_attention`` or ``full_attention``; None: the config's own settings)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
        kind = params.get("rope_type") or params.get("type") or "default"
    else:
        kind = rope_type(cfg)
    extra = {} if layer_type is None else {"layer_type": layer_type}
    if kind == "default":
        base = params.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        attn_scale = 1.0
    elif kind in ("linear", "llama3", "yarn", "longrope"):
        inv_freq, attn_scale = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"), **extra)
    else:
        raise ValueError(f"rope_type={kind!r} is not supported")
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attn_scale, emb.sin() * attn_scale
