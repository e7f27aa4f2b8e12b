"""pagedserve: an LLM serving engine. ``from pagedserve import LLM, SamplingParams``.

The repository's folders install under this one name: ``pagedserve.engine`` (the engine
core, the model side, loading, sampling), ``pagedserve.blockmgr`` (the paged KV cache's
block manager), ``pagedserve.kernels`` (attention and layer kernels), ``pagedserve.server``
(the OpenAI-compatible server and the ``pagedserve`` command) and ``pagedserve.loadtest``
(benchmarks and load tests).

Importing ``pagedserve`` changes nothing in the process (no environment variable, no
allocator setting) and loads nothing heavy: each public name below is imported from its
module when first used, so light modules such as :mod:`pagedserve.engine.envs` and
:mod:`pagedserve.engine.worker.process_tuning` can be used before torch is loaded. The process
tuning is applied when an engine starts (:func:`pagedserve.engine.worker.process_tuning.apply`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedserve.engine.loop.llm",
    "LLMEngine": "pagedserve.engine.loop.llm_engine",
    "AsyncEngine": "pagedserve.engine.loop.async_engine",
    "EngineDeadError": "pagedserve.engine.errors",
    "EngineSnapshot": "pagedserve.engine.loop.async_engine",
    "StepItem": "pagedserve.engine.loop.async_engine",
    "EngineConfig": "pagedserve.engine.config",
    "EngineInfo": "pagedserve.engine.loop.engine_info",
    "InputLimits": "pagedserve.engine.loop.engine_info",
    "EngineInputError": "pagedserve.engine.errors",
    "InputField": "pagedserve.engine.errors",
    "PromptTooLongError": "pagedserve.engine.errors",
    "SamplingParamError": "pagedserve.engine.errors",
    "TokenIdError": "pagedserve.engine.errors",
    "CompletionOutput": "pagedserve.engine.core.outputs",
    "Logprob": "pagedserve.engine.core.outputs",
    "RequestMetrics": "pagedserve.engine.core.outputs",
    "RequestOutput": "pagedserve.engine.core.outputs",
    "TokenLogprobs": "pagedserve.engine.core.outputs",
    "MAX_LOGPROBS": "pagedserve.engine.core.sampling_params",
    "SamplingParams": "pagedserve.engine.core.sampling_params",
    "LoRARequest": "pagedserve.engine.lora.request",
    "PoolingParams": "pagedserve.engine.core.pooling",
    "StructuredOutputsParams": "pagedserve.engine.structured.params",
    "ReasoningGate": "pagedserve.engine.structured.params",
    "StructuredOutputsError": "pagedserve.engine.errors",
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
