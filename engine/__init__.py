"""pagedserve engine: ``from engine import LLM, SamplingParams``."""

from engine.process_tuning import set_omp_spin, tune_malloc

# Before torch is imported: a short OpenMP spin, and a malloc that keeps its memory
# (see engine/process_tuning.py for why and how to turn each off).
set_omp_spin()
tune_malloc()

from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
