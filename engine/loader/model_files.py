"""The files of a Hugging Face style model folder, and reading them.

A folder holds ``config.json``, tokenizer files and the weights, one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from pagedserve.engine.errors import ModelFileError, ModelNotFoundError
from pagedserve.engine.jsonlimits import read_json_file, read_json_object
from pagedserve.engine.loader.safetensors_file import read_header

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


def is_complete_model_dir(path: Path) -> bool:
    """Return True if ``path`` holds a config and weights (single file or index)."""
    return (path / CONFIG_NAME).is_file() and (
        (path / WEIGHTS_NAME).is_file() or (path / WEIGHTS_INDEX_NAME).is_file()
    )


MULTIMODAL_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
"""Image-and-text architectures whose text model is served (text input only), and that
text model's architecture."""


def load_config(path: Path) -> transformers.PretrainedConfig:
    """Load the model config from a resolved model folder (of an architecture in
    :data:`MULTIMODAL_TEXT_MODELS`: its ``text_config``, as that text model's)."""
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    if arch in MULTIMODAL_TEXT_MODELS:
        if getattr(cfg, "quantization_config", None):
            raise ValueError(f"a quantized {arch} checkpoint is not supported: serve the "
                             "float checkpoint (quantization='int8' keeps its linears in int8)")
        text = cfg.text_config
        text.architectures = [MULTIMODAL_TEXT_MODELS[arch]]
        text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        return text
    return cfg


_TEXT_MODEL_PREFIXES = (("model.language_model.", "model."),
                        ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))  # fmt: skip
"""Where an image-and-text checkpoint keeps its text model's tensors (transformers 5's
names, then the older ones), and the names a text model's checkpoint gives them."""
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")  # fmt: skip


def text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name as a text model's checkpoint names it (an image-and-text
    checkpoint's text model), None for the tensors of its vision tower and projector;
    other names as they are."""
    for prefix, to in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None if name.startswith(_OTHER_TOWERS) else name


def load_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """Load the tokenizer (with its chat template) from a resolved model folder. A chat
    template that fails on a conversation of one user message is logged (a warning):
    the conversations it renders are refused one by one, naming it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    if getattr(tokenizer, "chat_template", None):
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}],
                                          tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - any error of the template's own
            logger.warning("the chat template of %s fails on a conversation of one user "
                           "message (%s: %s): chat requests are refused with the error unless "
                           "another template is given", path, type(e).__name__, e)
    return tokenizer


def eos_token_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """The ids that end a generation: ``generation_config.json``'s ``eos_token_id`` (one
    or a list) and the tokenizer's own, sorted."""
    ids: set[int] = set()
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        eos = read_json_object(gen_path, ModelFileError).get("eos_token_id")
        found = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in found):
            raise ModelFileError(f"{gen_path}: eos_token_id={str(eos)[:80]} must be a token "
                                 "id or a list of token ids")
        ids.update(found)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def weight_files(path: Path) -> list[Path]:
    """Return the safetensors files of a model folder, in index order, each one's header
    checked (:func:`pagedserve.engine.loader.safetensors_file.read_header`: a malformed
    file is refused before it is opened for its tensors)."""
    files = _weight_files(path)
    for file in files:
        read_header(file)
    return files


def _weight_files(path: Path) -> list[Path]:
    index = path / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            weight_map = read_json_file(index)["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
            if not all(isinstance(f, str) for f in files):
                raise TypeError("a shard name that is not a string")
            outside = [f for f in files if Path(f).name != f or f in ("", ".", "..")]
            if outside:
                raise ValueError(f"shard name {outside[0][:200]!r} is not a file name in the "
                                 "model's folder")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OSError) as e:
            raise ModelFileError(f"{index} is not a safetensors index (a JSON object whose "
                                 f"weight_map names each tensor's shard): {e!r}") from None
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
    checkpoint (a tied ``lm_head.weight`` is usually absent), those of an image-and-text
    checkpoint's text model as a text model's (:func:`text_model_name`; its vision
    tower's tensors are not read).
    """
    for file in weight_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                name = text_model_name(stored)
                if name is not None:
                    yield name, f.get_tensor(stored)
