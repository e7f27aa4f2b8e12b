"""Grammar-constrained decoding: constraints, backends (xgrammar, llguidance), the compile
pool and the per-step token bitmask.

:mod:`pagedserve.engine.structured.params` is torch-free and imports no backend; the backends are
imported only when an engine first compiles a grammar.
"""

from pagedserve.engine.errors import StructuredOutputsError
from pagedserve.engine.structured.params import ReasoningGate, StructuredOutputsParams

__all__ = ["ReasoningGate", "StructuredOutputsError", "StructuredOutputsParams"]
