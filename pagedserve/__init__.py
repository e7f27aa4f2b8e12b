"""pagedserve: an LLM serving engine. ``from pagedserve import LLM, SamplingParams``.

The repository's folders install under this one name: ``pagedserve.engine`` (the engine
core, the model side, loading, sampling), ``pagedserve.blockmgr`` (the paged KV cache's
block manager), ``pagedserve.kernels`` (attention and layer kernels), ``pagedserve.server``
(the OpenAI-compatible server and the ``pagedserve`` command) and ``pagedserve.loadtest``
(benchmarks and load tests).

Importing ``pagedserve`` changes nothing in the process (no environment variable, no
allocator setting) and loads nothing heavy: each public name below is imported from its
module when first used, so light modules such as :mod:`pagedserve.engine.envs` and
:mod:`pagedserve.engine.process_tuning` can be used before torch is loaded. The process
tuning is applied when an engine starts (:func:`pagedserve.engine.process_tuning.apply`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedserve.engine.llm",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "AsyncEngine": "pagedserve.engine.async_engine",
    "EngineDeadError": "pagedserve.engine.async_engine",
    "EngineSnapshot": "pagedserve.engine.async_engine",
    "StepItem": "pagedserve.engine.async_engine",
    "EngineConfig": "pagedserve.engine.config",
    "EngineInfo": "pagedserve.engine.engine_info",
    "InputLimits": "pagedserve.engine.engine_info",
    "EngineInputError": "pagedserve.engine.errors",
    "InputField": "pagedserve.engine.errors",
    "PromptTooLongError": "pagedserve.engine.errors",
    "SamplingParamError": "pagedserve.engine.errors",
    "TokenIdError": "pagedserve.engine.errors",
    "CompletionOutput": "pagedserve.engine.outputs",
    "Logprob": "pagedserve.engine.outputs",
    "RequestMetrics": "pagedserve.engine.outputs",
    "RequestOutput": "pagedserve.engine.outputs",
    "TokenLogprobs": "pagedserve.engine.outputs",
    "MAX_LOGPROBS": "pagedserve.engine.sampling_params",
    "SamplingParams": "pagedserve.engine.sampling_params",
    "LoRARequest": "pagedserve.engine.lora.request",
    "PoolingParams": "pagedserve.engine.pooling",
    "StructuredOutputsParams": "pagedserve.engine.structured.params",
    "ReasoningGate": "pagedserve.engine.structured.params",
    "StructuredOutputsError": "pagedserve.engine.structured.params",
}
"""Public name -> the module that defines it."""

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
