"""Model registry: HF architecture name -> implementation."""

from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM, DecoderSpec

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def build_model(hf_config) -> DecoderForCausalLM:
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"architectures={archs} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return DecoderForCausalLM(DecoderSpec.from_hf(hf_config))


__all__ = ["DecoderForCausalLM", "DecoderSpec", "SUPPORTED_ARCHITECTURES", "build_model"]
