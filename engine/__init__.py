"""pagedserve engine: ``from engine import LLM, SamplingParams``.

Importing ``engine`` changes nothing in the process (no environment variable, no
allocator setting) and loads nothing heavy: each name below is imported from its
module when first used, so light modules such as :mod:`engine.envs` and
:mod:`engine.process_tuning` can be used before torch is loaded. The process tuning is
applied when an engine starts (:func:`engine.process_tuning.apply`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}
"""Public name -> the module that defines it."""

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
