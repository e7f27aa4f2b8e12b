"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2/3,
and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE) over a paged KV cache.

The forward pass takes one packed, unpadded token tensor for the whole step (prefill
chunks and decode tokens of many requests together) and computes logits only for the
positions that sample. Q/K/V and gate/up projections are fused into one matmul each.
Numerics follow HF transformers (RMSNorm in float32, rotate-half RoPE with the same
frequency tables) so that greedy outputs match it token for token.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedserve.engine.models.checkpoint_names import QUANTIZED_PARTS, required_tensors
from pagedserve.engine.models.linear import (
    QuantEmbedding,
    QuantLinear,
    check_shape,
    project,
    put_rows,
)
from pagedserve.engine.models.moe import SparseMoE, moe_tensor
from pagedserve.engine.models.rope import rope_tables
from pagedserve.engine.models.spec import DecoderSpec
from pagedserve.kernels.interface import (
    AttentionBackend,
    AttentionMetadata,
    DecoderStack,
    LayerWeights,
)
from pagedserve.kernels.quant import QuantizedWeight, StackedWeight, quantize_int8

if TYPE_CHECKING:
    from pagedserve.engine.lora.weights import LoRAStep


LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The projections of a layer, as :meth:`DecoderForCausalLM.quantize_layout` names them."""


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: Any = None, index: int = 0) -> None:
        super().__init__()
        self.tp = tp
        """Tensor parallel (:class:`pagedserve.engine.parallel.group.TensorParallel`): this layer
        holds its rank's heads and MLP columns; o and down are all-reduced."""
        s = spec
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        self.eps = s.rms_norm_eps
        self.scale = s.scale
        self.window = s.window(index)
        """The layer's sliding window (0: it attends to the whole context)."""
        self.softcap = s.attn_softcap
        self.attn_options = {"window": self.window, "softcap": self.softcap} \
            if self.window or self.softcap else {}  # fmt: skip
        """What the attention backend is passed beside the scale (nothing for a layer that
        neither slides nor caps)."""
        self.gelu = s.activation == "gelu_tanh"
        self.qkv_proj = nn.Linear(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, s.hidden_size, bias=s.o_bias)
        self.moe = SparseMoE(s.hidden_size, s.moe) if s.moe and index in s.moe.layers else None
        """The layer's experts, in place of the dense MLP (``gate_up_proj`` and
        ``down_proj`` are then None)."""
        dense = self.moe is None
        self.gate_up_proj = nn.Linear(s.hidden_size, 2 * s.intermediate_size,
                                      bias=s.mlp_bias) if dense else None  # fmt: skip
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size,
                                   bias=s.mlp_bias) if dense else None  # fmt: skip
        self.input_layernorm = nn.Parameter(torch.ones(s.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(s.hidden_size))
        self.q_norm = nn.Parameter(torch.ones(s.head_dim)) if s.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(s.head_dim)) if s.qk_norm else None
        # Gemma: the attention's and the MLP's outputs are normed before their residual
        # adds (its checkpoints' post_attention_layernorm and post_feedforward_layernorm;
        # its pre_feedforward_layernorm is this layer's post_attention_layernorm).
        self.attn_out_norm = nn.Parameter(torch.ones(s.hidden_size)) if s.gemma_norms else None
        self.mlp_out_norm = nn.Parameter(torch.ones(s.hidden_size)) if s.gemma_norms else None
        self.intermediate_size = s.intermediate_size

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        attn: AttentionBackend,
        lora: LoRAStep | None = None,
        index: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer (number ``index``) on the residual stream: returns ``(mlp output,
        residual)``, with the step's LoRA adapters applied to its projections.

        The residual add of the previous layer is fused into this layer's first norm
        (``residual=None`` on the first layer, where ``hidden`` is the embedding).
        """
        ops = attn.ops
        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            out = project(getattr(self, name), x, ops)
            return out if lora is None else lora.apply(index, name, x, out)

        t = hidden.shape[0]
        if residual is None:
            residual, x = hidden, ops.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            residual, x = ops.add_rms_norm(residual, hidden, self.input_layernorm, self.eps)
        qkv = linear("qkv_proj", x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps).view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps).view_as(k)
        rope_forward = getattr(attn, "rope_forward", None)
        if rope_forward is not None:  # RoPE fused with the K/V write
            o = rope_forward(q, k, v, cos, sin, k_cache, v_cache, meta, self.scale, **self.attn_options)
        else:
            q, k = ops.rope(q, k, cos, sin)
            o = attn.forward(q, k, v.contiguous(), k_cache, v_cache, meta, self.scale,
                             **self.attn_options)  # fmt: skip
        attn_out = linear("o_proj", o.reshape(t, self.q_size))
        if self.tp is not None:
            self.tp.all_reduce(attn_out)
        if self.attn_out_norm is not None:
            attn_out = ops.rms_norm(attn_out, self.attn_out_norm, self.eps)
        residual, x = ops.add_rms_norm(residual, attn_out, self.post_attention_layernorm,
                                       self.eps)  # fmt: skip
        if self.moe is not None:
            out = self.moe(x, ops)
        else:
            proj = self.gate_up_proj
            if lora is None and getattr(proj, "input_order", None) is None:
                act = ops.gated_linear(x, proj.weight, proj.bias, self.gelu)
            else:  # an adapter adds to the product before its gate
                gate_up = linear("gate_up_proj", x)
                act = ops.gelu_tanh_mul(gate_up) if self.gelu else ops.silu_mul(gate_up)
            out = linear("down_proj", act)
        if self.tp is not None:
            self.tp.all_reduce(out)
        if self.mlp_out_norm is not None:
            out = ops.rms_norm(out, self.mlp_out_norm, self.eps)
        return out, residual

    def linears(self) -> Iterator[tuple[str, nn.Module]]:
        """``(name, module)`` of the layer's projections: :data:`LINEAR_NAMES`, or with
        experts ``qkv_proj``, ``o_proj`` and ``moe.<expert's projection>`` (not the
        routers)."""
        yield from (("qkv_proj", self.qkv_proj), ("o_proj", self.o_proj))
        if self.moe is None:
            yield from (("gate_up_proj", self.gate_up_proj), ("down_proj", self.down_proj))
        else:
            yield from ((f"moe.{n}", m) for n, m in self.moe.expert_linears())


class DecoderForCausalLM(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: Any = None) -> None:
        """``tp``: a :class:`pagedserve.engine.parallel.group.TensorParallel` whose ``shard`` is this
        rank's part of ``spec``; the model is then that part (``self.spec`` is the
        shard's, ``self.full_spec`` the whole model's)."""
        super().__init__()
        self.full_spec = spec
        self.tp = tp
        if tp is not None:
            spec = tp.shard.local_spec()
        self.spec = spec
        table = torch.empty(spec.vocab_size, spec.hidden_size)
        # Built on the meta device (a load), the table is not drawn at random: torch's
        # normal_ there imports torch._dynamo, 0.6-1.4 s of a GGUF model's load.
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=table if table.is_meta else None)
        self.layers = nn.ModuleList(DecoderLayer(spec, tp, i) for i in range(spec.num_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(
            spec.hidden_size, spec.vocab_size, bias=False)
        # RoPE tables [max_model_len, head_dim] in float32, set by ``set_rope``.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.layer_ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per ``spec.rope_keys`` entry (Gemma 3's layer types), that RoPE's tables;
        empty when every layer uses ``rope_cos``/``rope_sin``."""
        self._stack: DecoderStack | None = None
        """The layers as a backend's ``run_layers`` takes them; rebuilt after the weights
        or RoPE tables are replaced."""
        self._kv_layer_groups: tuple[int, ...] = ()

    @property
    def kv_layer_groups(self) -> tuple[int, ...]:
        """Per layer, the KV group whose block table it reads (set by the worker when the
        cache has several groups: a step's metadata then carries each group's)."""
        return self._kv_layer_groups

    @kv_layer_groups.setter
    def kv_layer_groups(self, groups: tuple[int, ...]) -> None:
        self._kv_layer_groups = tuple(groups)
        self._stack = None

    def set_rope(self, hf_config, max_model_len: int) -> None:
        device = self.embed_tokens.weight.device
        self.layer_ropes = {}
        for key in dict.fromkeys(self.spec.rope_keys):
            cos, sin = rope_tables(hf_config, self.spec.head_dim, max_model_len, key)
            self.layer_ropes[key] = cos.to(device), sin.to(device)
        if self.layer_ropes:  # the first layer's, for whatever reads one table
            self.rope_cos, self.rope_sin = self.layer_ropes[self.spec.rope_keys[0]]
        else:
            cos, sin = rope_tables(hf_config, self.spec.head_dim, max_model_len)
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        self._stack = None

    def decoder_stack(self) -> DecoderStack:
        """The layers' sizes and weights for a backend's ``run_layers`` (made once)."""
        if self._stack is None:
            s = self.spec
            ropes = [self.layer_ropes[key] if self.layer_ropes else (None, None)
                     for key in (s.rope_keys or [""] * len(self.layers))]  # fmt: skip
            groups = self.kv_layer_groups or (0,) * len(self.layers)
            self._stack = DecoderStack(
                hidden_size=s.hidden_size, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                head_dim=s.head_dim, intermediate_size=s.intermediate_size,
                eps=s.rms_norm_eps, scale=s.scale, rope_cos=self.rope_cos,
                rope_sin=self.rope_sin, activation=s.activation, softcap=s.attn_softcap,
                layers=tuple(LayerWeights(
                    input_norm=x.input_layernorm, post_norm=x.post_attention_layernorm,
                    qkv=x.qkv_proj.weight, o=x.o_proj.weight,
                    gate_up=getattr(x.gate_up_proj, "weight", None),
                    down=getattr(x.down_proj, "weight", None), qkv_bias=x.qkv_proj.bias,
                    o_bias=x.o_proj.bias, gate_up_bias=getattr(x.gate_up_proj, "bias", None),
                    down_bias=getattr(x.down_proj, "bias", None),
                    q_norm=x.q_norm, k_norm=x.k_norm, orders=tuple(
                        getattr(getattr(x, n), "input_order", None) for n in LINEAR_NAMES),
                    experts=None if x.moe is None else x.moe.stack_weights(),
                    window=x.window, attn_out_norm=x.attn_out_norm,
                    mlp_out_norm=x.mlp_out_norm, rope_cos=rope[0], rope_sin=rope[1],
                    kv_group=group,
                ) for x, rope, group in zip(self.layers, ropes, groups, strict=True)))  # fmt: skip
        return self._stack

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        attn: AttentionBackend,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (with ``lora``: the step's
        adapters applied, layer by layer)."""
        hidden = self._embed(input_ids, attn.ops)
        if self.spec.gemma_norms:  # in the model's dtype, as HF rounds it
            hidden = hidden * torch.tensor(self.spec.hidden_size ** 0.5, dtype=hidden.dtype)
        metas = meta.groups
        run_layers = None if self.tp is not None or lora is not None else \
            getattr(attn, "run_layers", None)  # fmt: skip
        fused = None if run_layers is None or not self.layers else run_layers(
            self.decoder_stack(), hidden, positions, kv_caches, meta)
        if fused is not None:
            hidden, residual = fused
            return attn.ops.add_rms_norm(residual, hidden, self.norm, self.spec.rms_norm_eps)[1]
        dtype = hidden.dtype
        tables = self.layer_ropes or {"": (self.rope_cos, self.rope_sin)}
        ropes = {key: (cos[positions].to(dtype).unsqueeze(1),
                       sin[positions].to(dtype).unsqueeze(1))
                 for key, (cos, sin) in tables.items()}  # fmt: skip
        keys = self.spec.rope_keys
        groups = self.kv_layer_groups if len(metas) > 1 else ()
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches,
                                                            strict=False)):  # fmt: skip
            cos, sin = ropes[keys[i] if keys else ""]
            hidden, residual = layer(hidden, residual, cos, sin, k_cache, v_cache,
                                     metas[groups[i]] if groups else meta, attn, lora, i)
        if residual is None:  # a model without layers
            return attn.ops.rms_norm(hidden, self.norm, self.spec.rms_norm_eps)
        return attn.ops.add_rms_norm(residual, hidden, self.norm, self.spec.rms_norm_eps)[1]

    def _embed(self, input_ids: torch.Tensor, ops: Any) -> torch.Tensor:
        if self.tp is None:
            return ops.embedding(input_ids, self.embed_tokens.weight)
        # Vocab-parallel: this rank's rows; the others' ids read zeros, then the sum.
        local = input_ids - self.tp.shard.vocab.start
        outside = (local < 0) | (local >= self.spec.vocab_size)
        hidden = ops.embedding(local.masked_fill(outside, 0), self.embed_tokens.weight)
        return self.tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def gated_weights(self) -> Iterator[torch.Tensor | QuantizedWeight]:
        """The dense MLPs' gate/up weights (``ops.gated_linear``'s)."""
        for layer in self.layers:
            if layer.moe is None:
                yield layer.gate_up_proj.weight

    def linear_weights(self) -> Iterator[torch.Tensor | QuantizedWeight]:
        """Every weight that goes through ``ops.linear``, the logits' included."""
        for layer in self.layers:
            yield from (proj.weight for _, proj in layer.linears())
            if layer.moe is not None:
                yield layer.moe.gate.weight
                if layer.moe.shared_expert_gate is not None:
                    yield layer.moe.shared_expert_gate.weight
        yield self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, ops: Any) -> torch.Tensor | None:
        """float32 logits of ``hidden`` through the backend's layer ops (tensor parallel:
        gathered on rank 0, None on the other ranks)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = ops.linear(hidden, weight)
        cap = self.spec.final_softcap
        if cap:  # Gemma 2, in the model's dtype as HF caps them
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        if self.tp is None:
            return logits
        return self.tp.gather_logits(logits, self.full_spec.vocab_size)

    # -- quantized weights --------------------------------------------------
    def quantize_layout(self, formats: dict[str, str | tuple[str, ...]]) -> None:
        """Before loading: keep the weights named in ``formats`` quantized. Keys are
        ``layers.{i}.{projection}`` (see :data:`LINEAR_NAMES`), ``embed_tokens`` and
        ``lm_head``; values are :data:`pagedserve.kernels.quant.FORMATS` names, or for a
        fused projection whose parts differ, one per part in row order (q, k, v; gate,
        up: a :class:`~pagedserve.kernels.quant.StackedWeight`). Their planes are
        allocated on the CPU; the checkpoint must then supply them in that format."""
        self._stack = None
        for name, fmt in formats.items():
            if name == "embed_tokens":
                s = self.spec
                self.embed_tokens = QuantEmbedding(
                    QuantizedWeight.empty(fmt, s.vocab_size, s.hidden_size))
                continue
            parent, attr = self._owner(name)
            old = getattr(parent, attr)
            if old is None:  # a tied lm_head
                continue
            bias = None if old.bias is None else torch.empty(old.bias.shape, dtype=torch.float32)
            if isinstance(fmt, tuple):
                weight = StackedWeight.empty(self._part_rows(parent, attr, fmt), old.in_features)
            else:
                weight = QuantizedWeight.empty(fmt, old.out_features, old.in_features)
            setattr(parent, attr, QuantLinear(weight, bias))

    @staticmethod
    def _part_rows(parent: nn.Module, attr: str,
                   fmts: tuple[str, ...]) -> list[tuple[str, int]]:  # fmt: skip
        """``(format, rows)`` of a fused projection's parts of formats ``fmts`` (q, k, v
        or gate, up), neighbours of one format merged."""
        old = getattr(parent, attr)
        if attr == "qkv_proj" and len(fmts) == 3:
            rows = [parent.q_size, parent.kv_size, parent.kv_size]
        elif attr == "gate_up_proj" and len(fmts) == 2:
            rows = [old.out_features // 2] * 2
        else:
            raise ValueError(f"{attr}: no parts of formats {fmts}")
        merged: list[tuple[str, int]] = []
        for fmt, n in zip(fmts, rows, strict=True):
            if merged and merged[-1][0] == fmt:
                merged[-1] = (fmt, merged[-1][1] + n)
            else:
                merged.append((fmt, n))
        return merged

    def quantized_to(self, device: torch.device) -> None:
        """Move the quantized weights' planes (and input orders) to ``device``
        (``Module.to`` does not: they are not parameters)."""
        self._stack = None
        for module in self.modules():
            if isinstance(module, (QuantLinear, QuantEmbedding)):
                module.weight = module.weight.to(device)
            if getattr(module, "input_order", None) is not None:
                module.input_order = module.input_order.to(device)

    def set_input_orders(self, orders: dict[str, torch.Tensor]) -> None:
        """Quantized projections (``layers.{i}.{name}``) whose weight columns are
        stored in the order ``orders[key]`` of their input (act-order checkpoints)."""
        for key, order in orders.items():
            parent, attr = self._owner(key)
            getattr(parent, attr).input_order = order.to(torch.int64)
        self._stack = None

    def _owner(self, key: str) -> tuple[nn.Module, str]:
        """The module that holds the projection a layout key names (``lm_head``,
        ``layers.{i}.{name}``, ``name`` as :meth:`DecoderLayer.linears` gives it), and
        the projection's attribute in it."""
        if key == "lm_head":
            return self, key
        _, i, path = key.split(".", 2)
        parent, _, attr = path.rpartition(".")
        layer = self.layers[int(i)]
        return (layer.get_submodule(parent) if parent else layer), attr

    def quantize_int8(self) -> None:
        """After loading: every linear weight to per-row int8 (the logits' too; a tied
        embedding table stays float for lookups and gets an int8 copy for the logits)."""
        self._stack = None
        for i, layer in enumerate(self.layers):
            for name, old in list(layer.linears()):
                if isinstance(old, nn.Linear):
                    parent, attr = self._owner(f"layers.{i}.{name}")
                    setattr(parent, attr, QuantLinear(quantize_int8(old.weight), old.bias))
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if isinstance(head, torch.Tensor):
            self.lm_head = QuantLinear(quantize_int8(head), None)

    # -- weights ------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF checkpoint tensors, fusing q/k/v and gate/up as they arrive."""
        self._stack = None
        spec = self.spec
        qkv_off = {"q_proj": 0, "k_proj": spec.num_heads * spec.head_dim,
                   "v_proj": (spec.num_heads + spec.num_kv_heads) * spec.head_dim}
        gu_off = {"gate_proj": 0, "up_proj": spec.intermediate_size}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb" in name:
                continue
            with torch.no_grad():
                if name == "lm_head.weight":
                    if self.lm_head is None:
                        continue
                    put_rows(self.lm_head, "weight", 0, tensor, name)
                elif name == "embed_tokens.weight":
                    put_rows(self.embed_tokens, "weight", 0, tensor, name)
                elif name == "norm.weight":
                    self._put_norm(self.norm, name, tensor)
                else:
                    self._load_layer_tensor(name, tensor, qkv_off, gu_off)
            loaded.add(name)
        required = required_tensors(spec, tied=self.lm_head is None)
        missing = sorted(required - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    def _load_layer_tensor(self, name: str, tensor: torch.Tensor, qkv_off, gu_off) -> None:
        parts = name.split(".")
        if parts[0] != "layers":
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        layer = self.layers[int(parts[1])]
        leaf = ".".join(parts[2:])
        proj = parts[-2]
        kind = parts[-1]  # weight | bias
        if kind in QUANTIZED_PARTS:
            raise ValueError(f"checkpoint tensor {name!r} is part of a quantized linear, but "
                             "the model's config names no quantization (quantization_config)")
        place = None if layer.moe is None else moe_tensor(layer.moe, parts[2:])
        if place is not None:
            half = proj in ("gate_proj", "up_proj", "w1", "w3")  # a half of a gate_up_proj
            put_rows(place[0], "weight", place[1], tensor, name,
                     place[0].out_features // 2 if half else None)  # fmt: skip
        elif parts[2] in ("mlp", "block_sparse_moe") and (layer.moe is not None or len(parts) != 5):
            n = "none" if layer.moe is None else len(layer.moe.experts)
            raise ValueError(f"unexpected checkpoint tensor {name!r} (layer {parts[1]}'s "
                             f"experts: {n})")
        elif proj in qkv_off:
            s = self.spec
            rows = (s.num_heads if proj == "q_proj" else s.num_kv_heads) * s.head_dim
            put_rows(layer.qkv_proj, kind, qkv_off[proj], tensor, name, rows)
        elif proj in gu_off:
            put_rows(layer.gate_up_proj, kind, gu_off[proj], tensor, name,
                     self.spec.intermediate_size)  # fmt: skip
        elif proj == "o_proj":
            put_rows(layer.o_proj, kind, 0, tensor, name)
        elif proj == "down_proj":
            put_rows(layer.down_proj, kind, 0, tensor, name)
        elif leaf in self._norm_names:
            self._put_norm(getattr(layer, self._norm_names[leaf]), name, tensor)
        elif leaf in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            self._put_norm(getattr(layer, proj), name, tensor)
        else:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")

    @property
    def _norm_names(self) -> dict[str, str]:
        """A layer's checkpoint norms -> this layer's attributes."""
        if self.spec.gemma_norms:
            return {"input_layernorm.weight": "input_layernorm",
                    "post_attention_layernorm.weight": "attn_out_norm",
                    "pre_feedforward_layernorm.weight": "post_attention_layernorm",
                    "post_feedforward_layernorm.weight": "mlp_out_norm"}
        return {"input_layernorm.weight": "input_layernorm",
                "post_attention_layernorm.weight": "post_attention_layernorm"}

    def _put_norm(self, target: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
        check_shape(name, tensor, target.shape)
        target.copy_(self._norm_weight(tensor))

    def _norm_weight(self, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint's RMSNorm weight as the norms here apply it (Gemma's: ``1 +
        weight``, added in float32)."""
        return tensor.float() + 1.0 if self.spec.gemma_norms else tensor
