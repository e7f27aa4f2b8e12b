"""The sizes and options of a Llama-family decoder, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
"""Gemma 2 and 3 (text): ``(1 + weight)`` RMSNorms around attention and MLP, a GELU-tanh
gated MLP, the embedding scaled by ``sqrt(hidden_size)``, sliding layers beside full
ones (Gemma 3: each with its own RoPE), Gemma 2's soft-capped scores and logits."""
_BY_MODEL_TYPE = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM"}
FUSED_CHECKPOINT_ARCHITECTURES = ("Phi3ForCausalLM",)
"""Architectures whose checkpoints hold each layer's q/k/v as one ``qkv_proj`` and its
gate/up as one ``gate_up_proj`` (gate first)."""
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", *MOE_ARCHITECTURES,
                           *FUSED_CHECKPOINT_ARCHITECTURES, *GEMMA_ARCHITECTURES)  # fmt: skip
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""HF ``hidden_act``/``hidden_activation`` names -> the gated MLP's activation here
(HF maps ``silu`` and ``swish`` to one function)."""


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


def layer_windows(cfg) -> tuple[int, ...]:
    """Per layer, the window it attends over (0: its whole context): the config's
    ``sliding_window`` for the layers ``layer_types`` names ``sliding_attention`` (every
    layer when the config has no ``layer_types``)."""
    window = sliding_window(cfg) or 0
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (window,) * cfg.num_hidden_layers
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def max_positions(cfg) -> int:
    """The positions the model was trained for (``max_position_embeddings``; 2,048 when
    the config leaves it out)."""
    return getattr(cfg, "max_position_embeddings", None) or 2048


def position_limit(cfg) -> tuple[int, str]:
    """The longest context (prompt and output) this engine serves ``cfg`` with exactly as
    HF transformers runs it, and the setting that sets it:

    * ``max_position_embeddings``;
    * a ``longrope`` model's ``original_max_position_embeddings``: past it HF switches
      every position to the long factors (not implemented: within it the short factors
      are the model's RoPE).
    """
    limit = max_positions(cfg)
    why = f"max_position_embeddings={limit}"
    rope = _rope(cfg)
    original = getattr(cfg, "original_max_position_embeddings", None) or rope.get(
        "original_max_position_embeddings")  # the top-level value wins, as in HF
    if rope_type(cfg) == "longrope" and original and original < limit:
        limit, why = original, (f"original_max_position_embeddings={original}: past it a "
                                "longrope model switches to its long factors, which this "
                                "engine does not do")
    return limit, why


def _layer_rope_keys(cfg) -> tuple[str, ...]:
    """Per layer, its ``rope_parameters`` entry where the config gives one per layer type
    (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``), else ()."""
    params = _rope(cfg)
    types = getattr(cfg, "layer_types", None)
    if not types or not all(isinstance(params.get(t), dict) for t in set(types)):
        return ()
    return tuple(types)


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
    activation: str = "silu"
    """The gated MLP's activation: ``silu`` or ``gelu_tanh`` (GELU, tanh approximation)."""
    gemma_norms: bool = False
    """Gemma's layer: RMSNorm weights applied as ``1 + weight`` (stored so after loading),
    the attention's and the MLP's outputs normed before each residual add, and the
    embedding scaled by ``sqrt(hidden_size)``."""
    attn_scale: float = 0.0
    """The scores' scale (0: ``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``)."""
    windows: tuple[int, ...] = ()
    """Per layer, the sliding window it attends over (0: the whole context); empty when
    no layer slides."""
    rope_keys: tuple[str, ...] = ()
    """Per layer, the ``rope_parameters`` entry of its RoPE (Gemma 3's
    ``sliding_attention``/``full_attention``); empty when every layer has the config's."""
    attn_softcap: float = 0.0
    """Scores capped by ``c * tanh(s / c)`` before the softmax (Gemma 2); 0: none."""
    final_softcap: float = 0.0
    """Logits capped likewise (Gemma 2); 0: none."""

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
        gemma = arch in GEMMA_ARCHITECTURES
        key = "hidden_activation" if gemma else "hidden_act"
        act = getattr(cfg, key, None) or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"{key}={act!r} is not supported: the gated MLP here is one of "
                             f"{', '.join(map(repr, ACTIVATIONS))}")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported: this engine "
                             "serves causal language models")
        # HF's Llama never slides, whatever its config holds.
        windows = () if arch == "LlamaForCausalLM" else layer_windows(cfg)
        rope_keys = _layer_rope_keys(cfg)
        if arch == "Gemma3ForCausalLM" and not rope_keys:
            raise ValueError("a Gemma 3 config without per-layer-type rope_parameters (its "
                             "local and global RoPE) is not supported: it needs "
                             "transformers >= 5")
        if ACTIVATIONS[act] != "silu" and arch in MOE_ARCHITECTURES:
            raise ValueError(f"{key}={act!r} is not supported for mixture-of-experts models: "
                             "their experts here are SiLU-gated")
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
            qk_norm=is_qwen3 or arch == "Gemma3ForCausalLM",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            moe=MoESpec.from_hf(cfg, arch),
            fused_checkpoint=arch in FUSED_CHECKPOINT_ARCHITECTURES,
            activation=ACTIVATIONS[act],
            gemma_norms=gemma,
            attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5 if gemma else 0.0,
            windows=windows if any(windows) else (),  # fmt: skip
            rope_keys=rope_keys,
            attn_softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
            final_softcap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0),
        )

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.attn_scale or self.head_dim ** -0.5

    def window(self, layer: int) -> int:
        """The sliding window of layer ``layer`` (0: its whole context)."""
        return self.windows[layer] if self.windows else 0

    def has_bias(self, proj: str) -> bool:
        """Whether the checkpoint projection ``proj`` (``q_proj`` .. ``down_proj``) has a
        bias in this model."""
        if proj in ("q_proj", "k_proj", "v_proj"):
            return self.qkv_bias
        return self.o_bias if proj == "o_proj" else self.mlp_bias
