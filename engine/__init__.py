"""pagedserve engine: ``from engine import LLM, SamplingParams``."""

from engine.process_tuning import set_omp_spin, tune_malloc

# Before torch is imported: a short OpenMP spin, and a malloc that keeps its memory
# (see engine/process_tuning.py for why and how to turn each off).
set_omp_spin()
tune_malloc()

from engine.async_engine import AsyncEngine, EngineDeadError, EngineSnapshot, StepItem  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine_info import EngineInfo, InputLimits  # noqa: E402
from engine.errors import (  # noqa: E402
    EngineInputError,
    InputField,
    PromptTooLongError,
    SamplingParamError,
    TokenIdError,
)
from engine.llm import LLM  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.outputs import (  # noqa: E402
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from engine.sampling_params import MAX_LOGPROBS, SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "MAX_LOGPROBS",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineInfo",
    "EngineInputError",
    "EngineSnapshot",
    "InputField",
    "InputLimits",
    "LLMEngine",
    "Logprob",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParamError",
    "SamplingParams",
    "StepItem",
    "TokenIdError",
    "TokenLogprobs",
    "__version__",
]
