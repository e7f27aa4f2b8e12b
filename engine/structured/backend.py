"""The grammar backend interface and the registry that loads one by name.

A backend compiles a :class:`StructuredOutputsParams` into a grammar; a grammar makes
one matcher per request (each of ``n`` siblings owns its own). A matcher fills its row
of a token bitmask, accepts the sampled token, rolls back and says when it has
terminated. The bitmask is ``int32 [rows, ceil(vocab / 32)]``: bit ``j`` of word ``w``
allows token ``32 * w + j`` (the layout xgrammar and llguidance share).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from collections.abc import Sequence
from typing import Any, Protocol

from pagedserve.engine.errors import StructuredOutputsError
from pagedserve.engine.structured.grammar_check import endless_rule
from pagedserve.engine.structured.params import StructuredOutputsParams
from pagedserve.engine.structured.schema import prefers_llguidance, unenforced_keyword

BACKENDS = {
    "xgrammar": ("pagedserve.engine.structured.xgrammar_backend", "xgrammar"),
    "llguidance": ("pagedserve.engine.structured.llguidance_backend", "llguidance"),
}
"""Backend name -> (module, the package it needs)."""
AUTO = "auto"
"""xgrammar, and llguidance for what xgrammar does not honour (:func:`choose_backend`)."""

_NATIVE_PREFIX = re.compile(r"^(\[[0-9:]+\] )?\S+\.(cc|cpp|h|rs):\d+: (Check failed: .*? is false: )?")


class Matcher(Protocol):
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask``."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""


class Grammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, constraint: StructuredOutputsParams) -> Grammar:
        """Compile ``constraint``; raises :class:`StructuredOutputsError` naming its field."""


def package_of(name: str) -> str:
    if name == AUTO:
        return BACKENDS["xgrammar"][1]
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend={name!r} is invalid: use one of "
                         f"{', '.join(BACKENDS)}")
    return BACKENDS[name][1]


def is_available(name: str) -> bool:
    return importlib.util.find_spec(package_of(name)) is not None


def load_backend(name: str, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> GrammarBackend:
    """The backend ``name`` for a model; a missing package is a clear error."""
    package = package_of(name)
    if not is_available(name):
        raise StructuredOutputsError(
            f"structured outputs need the {package!r} package (structured_outputs_backend="
            f"{name!r}), which is not installed: pip install 'pagedserve[structured]'")
    module = importlib.import_module(BACKENDS[name][0])
    return module.Backend(tokenizer, vocab_size, tuple(eos_token_ids))


def choose_backend(name: str, constraint: StructuredOutputsParams) -> str:
    """The backend that compiles ``constraint``: ``name``; with ``auto``, xgrammar unless
    ``constraint`` is a JSON schema that llguidance serves better (a string with length
    bounds, an ``allOf``: :func:`~pagedserve.engine.structured.schema.prefers_llguidance`)
    and llguidance is installed."""
    if name != AUTO:
        return name
    if constraint.kind == "json" and is_available("llguidance"):
        try:
            schema = json.loads(constraint.json)
        except ValueError:
            schema = None  # the backend reports it
        if prefers_llguidance(schema):
            return "llguidance"
    return "xgrammar"


def check_enforced(constraint: StructuredOutputsParams, backend: str) -> None:
    """Refuse a JSON schema with a keyword ``backend`` would not enforce (its outputs
    could break the schema), naming the keyword and where it is, and a grammar with a
    rule that cannot end."""
    if constraint.kind == "grammar":
        rule = endless_rule(constraint.grammar)
        if rule is not None:
            raise StructuredOutputsError(
                f"structured_outputs.grammar has no finite derivation: rule {rule!r} never "
                "ends (each of its alternatives needs a rule that never ends, such as "
                "itself)", "grammar")
    if constraint.kind != "json":
        return
    found = unenforced_keyword(json.loads(constraint.json), backend)
    if found is not None:
        keyword, path = found
        hint = (" (structured_outputs_backend='llguidance' enforces it)"
                if backend == "xgrammar" and keyword in ("allOf", "minLength", "maxLength")
                else "")
        raise StructuredOutputsError(
            f"structured_outputs.json uses {keyword!r} at {path}, which the {backend} "
            f"grammar backend does not enforce{hint}: remove it", "json")


def compile_error(constraint: StructuredOutputsParams, exc: BaseException) -> StructuredOutputsError:
    """A backend's compile failure as an error naming the constraint's field."""
    text = " ".join(str(exc).split())
    text = _NATIVE_PREFIX.sub("", text)
    return StructuredOutputsError(
        f"structured_outputs.{constraint.kind} cannot be compiled: {text}", constraint.kind)
