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
    "LLMEngine": "engine.llm_engine",
    "AsyncEngine": "engine.async_engine",
    "EngineDeadError": "engine.async_engine",
    "EngineSnapshot": "engine.async_engine",
    "StepItem": "engine.async_engine",
    "EngineConfig": "engine.config",
    "EngineInfo": "engine.engine_info",
    "InputLimits": "engine.engine_info",
    "EngineInputError": "engine.errors",
    "InputField": "engine.errors",
    "PromptTooLongError": "engine.errors",
    "SamplingParamError": "engine.errors",
    "TokenIdError": "engine.errors",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "TokenLogprobs": "engine.outputs",
    "MAX_LOGPROBS": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
    "LoRARequest": "engine.lora.request",
    "PoolingParams": "engine.pooling",
    "StructuredOutputsParams": "engine.structured.params",
    "ReasoningGate": "engine.structured.params",
    "StructuredOutputsError": "engine.structured.params",
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
