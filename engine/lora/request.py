"""A LoRA adapter as a request names it, and the checks of its ``adapter_config.json``.

Adapters are PEFT LoRA checkpoints: a directory with ``adapter_config.json`` and
``adapter_model.safetensors``. The config, and the weights' names and shapes (from the
safetensors header), are checked here without torch, so a server checks an adapter
before any request names it; the weights are read by :mod:`pagedserve.engine.lora.weights` on the
engine side. Torch-free.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.errors import JSONTextError, LoRAError
from pagedserve.engine.jsonlimits import decode_json, read_json_file

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may adapt (every linear of a decoder layer)."""
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fmt: skip
"""The decoder's projections and the target modules each fuses, in row order."""
FUSED_MLP = FUSED["gate_up_proj"] + FUSED["down_proj"]
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME_CHARS = 256
"""The longest adapter name (``lora_name``)."""
MAX_PATH_BYTES, MAX_PATH_PART_BYTES = 4096, 255
"""The longest ``lora_path`` and the longest name in it, UTF-8 encoded (Linux's
``PATH_MAX`` and ``NAME_MAX``)."""
MAX_CONFIG_BYTES = 2**20
"""The largest ``adapter_config.json`` read."""
MAX_LORA_ALPHA = 2.0**16
"""The largest ``|lora_alpha|`` served."""


def check_lora_name(name: object) -> str:
    """``name`` if it can name an adapter: printable text (no control characters, lone
    surrogates or separators but the space) of at most :data:`MAX_NAME_CHARS`; else a
    :class:`LoRAError` naming ``lora_name`` and the limit."""
    if not isinstance(name, str) or not name:
        raise LoRAError("lora_name must be a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise LoRAError(f"lora_name is {len(name)} characters long; the limit is "
                        f"{MAX_NAME_CHARS}")
    bad = next((i for i, c in enumerate(name) if not c.isprintable()), None)
    if bad is not None:
        raise LoRAError(f"lora_name has U+{ord(name[bad]):04X} at index {bad}: an adapter "
                        "name must be printable text (no control characters, lone "
                        "surrogates, or separators other than the space)")
    return name


def check_lora_path(path: object) -> None:
    """A :class:`LoRAError` naming ``lora_path`` unless it is a path the file system can
    take: UTF-8 text without control characters, at most :data:`MAX_PATH_BYTES` long and
    no name in it over :data:`MAX_PATH_PART_BYTES` (checked before the file system sees
    it, which would fail with an error of its own)."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise LoRAError("lora_path must be a non-empty string")
    text = str(path)
    bad = next((i for i, c in enumerate(text) if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise LoRAError(f"lora_path has the control character U+{ord(text[bad]):04X} at "
                        f"index {bad}; a path may have none")
    try:
        raw = text.encode()
    except UnicodeEncodeError as e:
        raise LoRAError(f"lora_path has a lone surrogate at index {e.start}; a path must "
                        "be UTF-8 text") from None
    if len(raw) > MAX_PATH_BYTES:
        raise LoRAError(f"lora_path is {len(raw)} bytes long; the limit is "
                        f"{MAX_PATH_BYTES} bytes")
    longest = max(len(part) for part in raw.split(b"/"))
    if longest > MAX_PATH_PART_BYTES:
        raise LoRAError(f"lora_path has a name of {longest} bytes; the limit is "
                        f"{MAX_PATH_PART_BYTES} bytes per name")


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to about ``limit`` characters."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than repr may write
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
            raise LoRAError(f"lora_int_id={_short(self.lora_int_id)} is invalid: must be "
                            "an integer >= 1")
        check_lora_name(self.lora_name)

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


_KEY = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


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
    check_lora_path(path)
    root = Path(path)
    cfg_path = root / CONFIG_FILE
    try:  # (is_file raises what is not a missing file: a directory it may not search)
        has_config, has_weights = cfg_path.is_file(), (root / WEIGHTS_FILE).is_file()
    except OSError as e:
        raise LoRAError(f"the LoRA adapter at {str(root)!r} cannot be read: {e}") from None
    if not has_config:
        raise LoRAError(f"the LoRA adapter at {str(root)!r} has no {CONFIG_FILE}")
    if not has_weights:
        raise LoRAError(f"the LoRA adapter at {str(root)!r} has no {WEIGHTS_FILE} (only "
                        "safetensors weights are read)")
    try:
        cfg = read_json_file(cfg_path, max_bytes=MAX_CONFIG_BYTES)
    except OSError as e:
        raise LoRAError(f"{cfg_path} is not readable: {e}") from None
    except JSONTextError as e:
        raise LoRAError(str(e)) from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_path} must hold a JSON object")
    return _config(cfg, str(root), max_rank)


def _config(cfg: dict, root: str, max_rank: int) -> AdapterConfig:
    """What the engine uses of a config's fields, each checked."""

    def unsupported(key: str, value: object, why: str) -> LoRAError:
        return LoRAError(f"the LoRA adapter at {root!r} has {key}={_short(value)}: {why}")

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
    # (a comparison, not float(): an integer past float64 would overflow; NaN fails it)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) \
            or not abs(alpha) <= MAX_LORA_ALPHA:  # fmt: skip
        raise unsupported("lora_alpha", alpha, "must be a finite number with "
                                               f"|lora_alpha| <= {MAX_LORA_ALPHA:g}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise unsupported("use_rslora", rslora, "must be true or false")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # PEFT allows a regex; the weights say what it matched
        targets = TARGET_MODULES
    if not isinstance(targets, list | tuple) or not targets:
        raise unsupported("target_modules", targets, "must be a non-empty list")
    names = tuple(str(t).rsplit(".", 1)[-1] for t in targets)
    bad = [t for t in names if t not in TARGET_MODULES]
    if bad:
        raise unsupported("target_modules", list(targets),
                          f"{_short(bad[0])} is not served (the served targets are "
                          f"{TARGET_MODULES})")
    return AdapterConfig(rank, float(alpha), rslora, names)


def check_adapter(path: str | Path, limits: LoRALimits) -> tuple[AdapterConfig, dict]:
    """Read and check an adapter against a model: its config, and each weight's name and
    shape from the safetensors header. Returns the config and ``{(layer, module): {"A":
    name, "B": name}}``; a :class:`LoRAError` names what does not fit."""
    cfg = read_adapter_config(path, limits.max_rank)
    file = Path(path) / WEIGHTS_FILE
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, shape in _header_shapes(file, header_limit(limits)).items():
        m = _KEY.search(name)
        if m is None or m.group(2) not in TARGET_MODULES:
            raise LoRAError(f"{file}: tensor {_short(name)} is not the lora_A/lora_B weight "
                            "of a decoder layer's projection (adapters of lm_head or the "
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
            raise LoRAError(f"{file}: tensor {name!r} has shape {_short(shape)}; this model "
                            f"and r={cfg.rank} need {want}")
        found.setdefault((layer, module), {})[ab] = name
    for (layer, module), ab in found.items():
        if len(ab) != 2:
            raise LoRAError(f"{file}: layer {layer} {module} has lora_{''.join(ab)} only; "
                            "both lora_A and lora_B are needed")
    return cfg, found


def header_limit(limits: LoRALimits) -> int:
    """The largest safetensors header an adapter of the model may have: 1 KiB per tensor
    it can have (A and B of every target module of every layer), and 1 MiB more for the
    metadata."""
    return 2**20 + 2**10 * 2 * len(TARGET_MODULES) * limits.num_layers


def _header_shapes(file: Path, max_bytes: int) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a safetensors file declares (its JSON header, at most
    ``max_bytes``)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > max_bytes:
                raise LoRAError(f"{file} has a safetensors header of {n} bytes; the limit "
                                f"for an adapter of this model is {max_bytes} bytes")
            header = decode_json(f.read(n), f"{file}'s safetensors header", max_size=n)
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, JSONTextError, struct.error, KeyError, TypeError, AttributeError) as e:
        raise LoRAError(f"{file} is not a readable safetensors file: {e}") from None
