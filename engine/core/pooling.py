"""Embeddings: a prompt's final hidden states pooled into one vector (``LLM.embed``,
``/v1/embeddings``).

An embedding request is a prompt with no output tokens and :class:`PoolingParams`: it is
scheduled as any prompt (chunked, batched with generation) and its vector is taken from
the hidden states after the model's final norm, as ``AutoModel``'s
``last_hidden_state``:

* ``LAST``: the last prompt token's (decoder embedding models: Qwen3-Embedding, e5-mistral);
* ``MEAN``: the mean over the prompt's tokens;
* ``CLS``: the first token's;

then optionally cut to its first ``dimensions`` (Matryoshka) and L2-normalized. The model's
own choice is read from its sentence-transformers files (``modules.json`` and the pooling
module's ``config.json``); without them it is ``LAST``, normalized. Torch-free: the
model runner's side, which pools the hidden states, is :mod:`pagedserve.engine.worker.pooler`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.engine.errors import EngineInputError, InputField
from pagedserve.engine.jsonlimits import read_json_file

if TYPE_CHECKING:
    from pagedserve.engine.core.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.engine.core.pooling")

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How a prompt becomes an embedding; None fields take the model's defaults."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    """Keep the first ``dimensions`` values (before normalizing)."""

    def resolved(self, defaults: PoolingParams, hidden_size: int,
                 params: SamplingParams | None = None) -> PoolingParams:  # fmt: skip
        """These parameters with the model's defaults filled in, checked against the
        model and the request's ``params`` (one sequence, no output tokens); an
        :class:`EngineInputError` names the field."""
        if params is not None and params.n != 1:
            raise EngineInputError(f"n={params.n} is invalid for an embedding request: "
                                   "a prompt has one embedding", InputField.N)
        if params is not None and params.max_tokens != 0:
            raise EngineInputError(f"max_tokens={params.max_tokens!r} is invalid for an "
                                   "embedding request: it generates nothing (max_tokens=0)",
                                   InputField.MAX_TOKENS)
        kind = (self.pooling_type or defaults.pooling_type or "LAST").upper()
        if kind not in POOLING_TYPES:
            raise EngineInputError(f"pooling_type={self.pooling_type!r} is invalid: must be "
                                   f"one of {POOLING_TYPES}", InputField.POOLING_TYPE)
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)
                                 or not 1 <= dims <= hidden_size):
            raise EngineInputError(f"dimensions={dims!r} is invalid: must be an integer in "
                                   f"[1, {hidden_size}] (the model's hidden size)",
                                   InputField.DIMENSIONS)
        normalize = self.normalize if self.normalize is not None else defaults.normalize
        return replace(self, pooling_type=kind,
                       normalize=True if normalize is None else bool(normalize))

    @property
    def whole_prompt(self) -> bool:
        """Whether every prompt token's hidden state is needed (no prefix cache hits)."""
        return self.pooling_type != "LAST"


def pooling_defaults(model_path: str | Path) -> PoolingParams:
    """The pooling a model's sentence-transformers files name (``modules.json`` and its
    pooling module's ``config.json``); empty fields without them."""
    root = Path(model_path)
    try:
        modules = read_json_file(root / "modules.json")
        pool_dir = next(m.get("path", "") for m in modules
                        if str(m.get("type", "")).endswith("Pooling"))
        cfg = read_json_file(root / pool_dir / "config.json")
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):  # JSONTextError too
        return PoolingParams()
    kind = next((v for k, v in _ST_MODES.items() if cfg.get(k)), None)
    other = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v
             and k not in _ST_MODES]  # fmt: skip
    if kind is None and other:
        logger.warning("%s: the model pools with %s, which is not served; embeddings "
                       "pool the last token unless a request says otherwise", root, other)
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    return PoolingParams(pooling_type=kind, normalize=normalize)
