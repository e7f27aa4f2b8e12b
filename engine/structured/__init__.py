"""Grammar-constrained decoding: specs, backends (xgrammar, llguidance), the compile
pool and the per-step token bitmask.

:mod:`engine.structured.params` is torch-free and imports no backend; the backends are
imported only when an engine first compiles a grammar.
"""

from engine.structured.params import (
    ReasoningGate,
    StructuredOutputsError,
    StructuredOutputsParams,
)

__all__ = ["ReasoningGate", "StructuredOutputsError", "StructuredOutputsParams"]
