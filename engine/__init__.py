"""pagedserve engine: ``from engine import LLM, SamplingParams``."""

import os

# OpenMP threads that busy-wait stall for milliseconds whenever another process or thread
# (the server's event loop, a load generator) holds a core; passive waiting avoids that.
# It only takes effect if torch has not been imported yet.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE") if "GOMP_SPINCOUNT" not in os.environ else None

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
