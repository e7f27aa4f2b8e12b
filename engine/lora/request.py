"""A LoRA adapter as a request names it, and the checks of its ``adapter_config.json``.

Adapters are PEFT LoRA checkpoints: a directory with ``adapter_config.json`` and
``adapter_model.safetensors``. The config, and the weights' names and shapes (from the
safetensors header), are checked here without torch, so a server checks an adapter
before any request names it; the weights are read by :mod:`pagedserve.engine.lora.weights` on the
engine side. Torch-free.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.errors import LoRAError

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may adapt (every linear of a decoder layer)."""
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fmt: skip
"""The decoder's projections and the target modules each fuses, in row order."""
FUSED_MLP = FUSED["gate_up_proj"] + FUSED["down_proj"]
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs with.

    ``lora_int_id`` (>= 1) identifies the adapter in the engine: requests naming the same
    id share its loaded weights, and their KV cache blocks are shared only with requests
    of the same adapter (the adapter is part of every block's prefix cache key).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:  # fmt: skip
            raise LoRAError(f"lora_int_id={self.lora_int_id!r} is invalid: must be an "
                            "integer >= 1")
        if not self.lora_name:
            raise LoRAError("lora_name must be a non-empty string")

    @property
    def cache_key(self) -> str:
        """What the adapter adds to the prefix cache's block keys."""
        return f"{self.lora_int_id}:{self.lora_name}:{self.lora_path}"


@dataclass(frozen=True, slots=True)
class LoRALimits:
    """What an adapter must fit: the engine's ``max_lora_rank`` and the model's layers
    and ``(out, in)`` size of each target module; ``expert_layers``: the layers whose MLP
    is a mixture of experts, which takes no adapter (their attention does)."""

    max_rank: int
    num_layers: int
    shapes: tuple[tuple[str, int, int], ...]
    expert_layers: tuple[int, ...] = ()

    @classmethod
    def of(cls, spec, max_rank: int) -> LoRALimits:
        """For a model of ``spec`` (:class:`pagedserve.engine.models.DecoderSpec`)."""
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        h, m = spec.hidden_size, spec.intermediate_size
        moe = getattr(spec, "moe", None)
        return cls(max_rank, spec.num_layers, (
            ("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
            ("gate_proj", m, h), ("up_proj", m, h), ("down_proj", h, m)),
            tuple(moe.layers) if moe is not None else ())

    def takes(self, layer: int, module: str) -> bool:
        """Whether ``module`` of ``layer`` can be adapted (not an MLP made of experts)."""
        return layer not in self.expert_layers or module not in FUSED_MLP

    def shape_of(self, module: str) -> tuple[int, int]:
        return next((o, i) for name, o, i in self.shapes if name == module)

    def adapter_bytes(self, element_size: int) -> int:
        """The most an adapter takes loaded (rank ``max_rank``, every target it can have:
        no MLP on the layers with experts): per fused projection ``A [n r, in]`` and a
        dense ``B [out, n r]`` for its ``n`` modules."""
        r, size = self.max_rank, dict((m, (o, i)) for m, o, i in self.shapes)
        total = 0
        for group in FUSED.values():
            cols = r * len(group)
            layers = sum(self.takes(i, group[0]) for i in range(self.num_layers))
            total += (cols * size[group[0]][1] + sum(size[m][0] for m in group) * cols) * layers
        return total * element_size


_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What the engine uses of an ``adapter_config.json``."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """The factor of ``B @ A`` (``alpha / r``; ``alpha / sqrt(r)`` with rsLoRA)."""
        return self.alpha / (self.rank ** 0.5 if self.use_rslora else self.rank)


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """Read and check an adapter directory's config; a :class:`LoRAError` says what an
    adapter has that the engine does not serve."""
    root = Path(path)
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise LoRAError(f"the LoRA adapter at {str(root)!r} has no {CONFIG_FILE}")
    if not (root / WEIGHTS_FILE).is_file():
        raise LoRAError(f"the LoRA adapter at {str(root)!r} has no {WEIGHTS_FILE} (only "
                        "safetensors weights are read)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_path} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_path} must hold a JSON object")

    def unsupported(key: str, value: object, why: str) -> LoRAError:
        return LoRAError(f"the LoRA adapter at {str(root)!r} has {key}={value!r}: {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise unsupported("peft_type", cfg["peft_type"], "only LORA adapters are served")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if cfg.get(key, ok) != ok:
            raise unsupported(key, cfg[key], f"only {key}=false is served")
    if cfg.get("bias", "none") != "none":
        raise unsupported("bias", cfg["bias"], "only bias='none' is served")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise unsupported(key, cfg[key], "not served (every module must share r and "
                                             "lora_alpha, and no module is replaced whole)")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise unsupported("r", rank, "must be an integer >= 1")
    if rank > max_rank:
        raise unsupported("r", rank, f"larger than max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise unsupported("lora_alpha", alpha, "must be a number")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # PEFT allows a regex; the weights say what it matched
        targets = TARGET_MODULES
    if not isinstance(targets, list | tuple) or not targets:
        raise unsupported("target_modules", targets, "must be a non-empty list")
    names = tuple(str(t).rsplit(".", 1)[-1] for t in targets)
    bad = [t for t in names if t not in TARGET_MODULES]
    if bad:
        raise unsupported("target_modules", list(targets),
                          f"{bad[0]!r} is not served (the served targets are {TARGET_MODULES})")
    return AdapterConfig(rank, float(alpha), bool(cfg.get("use_rslora", False)), names)


def check_adapter(path: str | Path, limits: LoRALimits) -> tuple[AdapterConfig, dict]:
    """Read and check an adapter against a model: its config, and each weight's name and
    shape from the safetensors header. Returns the config and ``{(layer, module): {"A":
    name, "B": name}}``; a :class:`LoRAError` names what does not fit."""
    cfg = read_adapter_config(path, limits.max_rank)
    file = Path(path) / WEIGHTS_FILE
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, shape in _header_shapes(file).items():
        m = _KEY.search(name)
        if m is None or m.group(2) not in TARGET_MODULES:
            raise LoRAError(f"{file}: tensor {name!r} is not the lora_A/lora_B weight of a "
                            "decoder layer's projection (adapters of lm_head or the "
                            "embeddings are not served)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= limits.num_layers:
            raise LoRAError(f"{file}: tensor {name!r} is for layer {layer}; the model has "
                            f"{limits.num_layers}")
        if not limits.takes(layer, module):
            raise LoRAError(f"{file}: tensor {name!r} adapts layer {layer}'s MLP, a mixture "
                            "of experts; adapters of experts are not served (of the "
                            "attention, and of dense MLP layers, they are)")
        out_f, in_f = limits.shape_of(module)
        want = (cfg.rank, in_f) if ab == "A" else (out_f, cfg.rank)
        if shape != want:
            raise LoRAError(f"{file}: tensor {name!r} has shape {shape}; this model and "
                            f"r={cfg.rank} need {want}")
        found.setdefault((layer, module), {})[ab] = name
    for (layer, module), ab in found.items():
        if len(ab) != 2:
            raise LoRAError(f"{file}: layer {layer} {module} has lora_{''.join(ab)} only; "
                            "both lora_A and lora_B are needed")
    return cfg, found


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a safetensors file declares (its JSON header)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 2**20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as e:
        raise LoRAError(f"{file} is not a readable safetensors file: {e}") from None

