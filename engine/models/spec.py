"""The sizes and options of a Llama-family decoder, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, cfg) -> DecoderSpec:
        arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
        model_type = getattr(cfg, "model_type", "llama")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        is_qwen2 = model_type == "qwen2" or arch.startswith("Qwen2")
        is_qwen3 = model_type == "qwen3" or arch.startswith("Qwen3")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
                and model_type == "mistral":
            raise ValueError(
                f"model_type={model_type!r} with sliding_window={cfg.sliding_window} is not supported"
            )
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=is_qwen3,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
        )

    def has_bias(self, proj: str) -> bool:
        """Whether the checkpoint projection ``proj`` (``q_proj`` .. ``down_proj``) has a
        bias in this model."""
        if proj in ("q_proj", "k_proj", "v_proj"):
            return self.qkv_bias
        return self.o_bias if proj == "o_proj" else self.mlp_bias
