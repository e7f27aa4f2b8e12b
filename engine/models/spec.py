"""The sizes and options of a Llama-family decoder, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_BY_MODEL_TYPE = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "phi3": "Phi3ForCausalLM"}
FUSED_CHECKPOINT_ARCHITECTURES = ("Phi3ForCausalLM",)
"""Architectures whose checkpoints hold each layer's q/k/v as one ``qkv_proj`` and its
gate/up as one ``gate_up_proj`` (gate first)."""
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", *MOE_ARCHITECTURES,
                           *FUSED_CHECKPOINT_ARCHITECTURES)  # fmt: skip


def architecture(cfg) -> str:
    """The HF architecture of a transformers config: its first ``architectures`` entry,
    else the one its ``model_type`` names (Llama's by default)."""
    archs = getattr(cfg, "architectures", None)
    if archs:
        return archs[0]
    return _BY_MODEL_TYPE.get(getattr(cfg, "model_type", "llama"), "LlamaForCausalLM")


def _rope(cfg) -> dict:
    """The config's RoPE settings (``rope_parameters``, or the older ``rope_scaling``)."""
    return getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}


def rope_type(cfg) -> str:
    """The RoPE type of the config's settings (:func:`_rope`: their ``rope_type``, or the
    older ``type``), ``"default"`` without one."""
    params = _rope(cfg)
    return params.get("rope_type") or params.get("type") or "default"


def sliding_window(cfg) -> int | None:
    """The attention window of a config whose layers (some or all) attend to their last
    ``sliding_window`` positions only, else None."""
    window = getattr(cfg, "sliding_window", None)  # Qwen's configs null it without
    if not window:  # use_sliding_window; Mistral's and Phi-3's ignore that key
        return None
    types = getattr(cfg, "layer_types", None)
    return window if types is None or "sliding_attention" in types else None


def max_positions(cfg) -> int:
    """The positions the model was trained for (``max_position_embeddings``; 2,048 when
    the config leaves it out)."""
    return getattr(cfg, "max_position_embeddings", None) or 2048


def position_limit(cfg) -> tuple[int, str]:
    """The longest context (prompt and output) this engine serves ``cfg`` with exactly as
    HF transformers runs it, and the setting that sets it:

    * ``max_position_embeddings``;
    * ``sliding_window``: past it the attention would slide (not implemented: within it
      full causal attention is the same computation);
    * a ``longrope`` model's ``original_max_position_embeddings``: past it HF switches
      every position to the long factors (not implemented: within it the short factors
      are the model's RoPE).
    """
    limit = max_positions(cfg)
    why = f"max_position_embeddings={limit}"
    window = sliding_window(cfg)
    if window is not None and window < limit:
        limit, why = window, (f"sliding_window={window}: a longer context would slide the "
                              "attention window, which this engine does not do")
    rope = _rope(cfg)
    original = getattr(cfg, "original_max_position_embeddings", None) or rope.get(
        "original_max_position_embeddings")  # the top-level value wins, as in HF
    if rope_type(cfg) == "longrope" and original and original < limit:
        limit, why = original, (f"original_max_position_embeddings={original}: past it a "
                                "longrope model switches to its long factors, which this "
                                "engine does not do")
    return limit, why


@dataclass(frozen=True, slots=True)
class MoESpec:
    """The sparse mixture-of-experts MLP of some layers (Mixtral, Qwen2-MoE, Qwen3-MoE).

    A token's router logits go through a float32 softmax; its ``top_k`` experts (SwiGLU
    MLPs of width ``intermediate_size``) run with those probabilities as weights,
    renormalized to sum 1 when ``norm_topk_prob``. Qwen2-MoE adds a shared expert
    (width ``shared_intermediate_size``, 0 when none) scaled by ``sigmoid`` of its own
    one-row gate."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int
    layers: tuple[int, ...]
    """The layers with experts; the others have the dense MLP of the spec's width."""
    mixtral_names: bool
    """Checkpoint names ``block_sparse_moe.experts.E.w1/w2/w3`` (Mixtral) rather than
    ``mlp.experts.E.gate_proj/down_proj/up_proj``."""
    float32_weights: bool
    """The experts' outputs are scaled by the float32 routing weights (Mixtral) rather
    than by weights cast to the model's dtype (Qwen)."""

    @classmethod
    def from_hf(cls, cfg, arch: str) -> MoESpec | None:
        if arch not in MOE_ARCHITECTURES:
            return None
        mixtral = arch == "MixtralForCausalLM"
        num_experts = cfg.num_local_experts if mixtral else cfg.num_experts
        if not num_experts and not mixtral:  # num_experts=0: every layer is dense
            return None
        top_k = cfg.num_experts_per_tok
        if not 1 <= top_k <= num_experts:
            key = "num_local_experts" if mixtral else "num_experts"
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and "
                             f"{key}={num_experts}")
        if mixtral:
            layers = tuple(range(cfg.num_hidden_layers))
        else:
            step = getattr(cfg, "decoder_sparse_step", 1) or 1
            dense = set(getattr(cfg, "mlp_only_layers", None) or ())
            layers = tuple(i for i in range(cfg.num_hidden_layers)
                           if i not in dense and (i + 1) % step == 0)
        return cls(
            num_experts=num_experts, top_k=top_k,
            intermediate_size=cfg.intermediate_size if mixtral else cfg.moe_intermediate_size,
            norm_topk_prob=mixtral or bool(getattr(cfg, "norm_topk_prob", False)),
            shared_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
            layers=layers, mixtral_names=mixtral, float32_weights=mixtral)


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
    moe: MoESpec | None = None
    """The mixture-of-experts layers, if the model has any."""
    fused_checkpoint: bool = False
    """Checkpoint projections ``qkv_proj`` and ``gate_up_proj`` (Phi-3) rather than
    ``q_proj`` .. ``up_proj``: :func:`pagedserve.engine.models.checkpoint_names.unfuse` splits them."""

    @classmethod
    def from_hf(cls, cfg) -> DecoderSpec:
        """The spec of a transformers config; a config this engine does not compute as HF
        does (another architecture, activation or partial RoPE) is a ``ValueError`` naming
        the setting."""
        archs = getattr(cfg, "architectures", None) or [architecture(cfg)]
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"architectures={archs} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = architecture(cfg)
        model_type = getattr(cfg, "model_type", "llama")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        is_qwen2 = model_type == "qwen2" or arch.startswith("Qwen2")
        is_qwen3 = model_type == "qwen3" or arch.startswith("Qwen3")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        partial = _rope(cfg).get("partial_rotary_factor") or getattr(
            cfg, "partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported: RoPE turns "
                             "every dimension of a head here")
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # one function under two names, as in HF
            raise ValueError(f"hidden_act={act!r} is not supported: the MLP here is SiLU-gated "
                             "(hidden_act='silu')")
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=bool(getattr(cfg, "qkv_bias", is_qwen2)) or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=is_qwen3,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            moe=MoESpec.from_hf(cfg, arch),
            fused_checkpoint=arch in FUSED_CHECKPOINT_ARCHITECTURES,
        )

    def has_bias(self, proj: str) -> bool:
        """Whether the checkpoint projection ``proj`` (``q_proj`` .. ``down_proj``) has a
        bias in this model."""
        if proj in ("q_proj", "k_proj", "v_proj"):
            return self.qkv_bias
        return self.o_bias if proj == "o_proj" else self.mlp_bias
