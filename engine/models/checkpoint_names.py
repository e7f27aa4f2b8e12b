"""Checkpoint tensor names and the model weights they load into."""

from __future__ import annotations

_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "o_proj": "o_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
          "down_proj": "down_proj"}  # fmt: skip


def layout_key(hf: str) -> str | None:
    """The :meth:`engine.models.decoder.DecoderForCausalLM.quantize_layout` key of a
    checkpoint weight (``layers.{i}.{fused projection}``, ``embed_tokens``, ``lm_head``),
    or None for a weight that is never quantized (norms, biases)."""
    if hf == "model.embed_tokens.weight":
        return "embed_tokens"
    if hf == "lm_head.weight":
        return "lm_head"
    parts = hf.split(".")
    if parts[-1] != "weight" or parts[-2] not in _FUSED:
        return None
    return f"layers.{parts[2]}.{_FUSED[parts[-2]]}"
