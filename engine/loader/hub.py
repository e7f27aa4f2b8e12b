"""A model reference resolved to a local folder: a path, a GGUF file (converted once into
the cache), the embedded default model, or a Hugging Face hub id (its local cache, or a
download when the network is allowed)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pagedserve.engine import envs
from pagedserve.engine.errors import ModelNotFoundError
from pagedserve.engine.loader.default_model import (
    DEFAULT_MODEL_NAME,
    convert_default_model,
    convert_gguf_model,
    is_gguf_file,
)
from pagedserve.engine.loader.model_files import CONFIG_NAME

logger = logging.getLogger(__name__)

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def _hub_offline() -> bool:
    """Return True if the Hugging Face hub must not be contacted."""
    if envs.hf_hub_offline():
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


def resolve_model_path(model: str | None, revision: str | None = None,
                       weights: bool = True) -> Path:  # fmt: skip
    """Resolve a model reference to a local Hugging Face style folder.

    Args:
        model: ``None`` or :data:`DEFAULT_MODEL_NAME` for the embedded default
            (converted once into the pagedserve cache), a local ``.gguf`` file (the
            same), a local folder containing
            ``config.json``, or a hub id ``"org/name"`` (local HF cache first,
            download only when the network is allowed).
        revision: hub revision (branch, tag or commit); ignored for local folders
            and the embedded default.
        weights: False when a GGUF file is served in its own blocks: its folder then
            holds only what its header gives (config, tokenizer, generation config).

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
    if is_gguf_file(model):
        if revision:
            logger.warning("revision=%r ignored for the GGUF file %s", revision, path)
        return convert_gguf_model(path, weights=weights)
    if path.exists():
        return _resolve_local(path)
    if _looks_like_path(model):
        raise ModelNotFoundError(
            f"Model path {model!r} does not exist (and is not a hub id of the form 'org/name')."
        )
    return _resolve_hub(model, revision)
