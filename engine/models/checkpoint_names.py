"""Checkpoint tensor names and the model weights they load into."""

from __future__ import annotations

from engine.lora.request import FUSED

_FUSED = {part: fused for fused, parts in FUSED.items() for part in parts}
PROJECTIONS = tuple(_FUSED)
"""A decoder layer's checkpoint projections, ``q_proj`` .. ``down_proj``."""
QUANTIZED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
"""The tensors of a GPTQ or AWQ linear (``{module}.{part}``; ``g_idx``: GPTQ's, optional)."""


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
