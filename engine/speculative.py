"""Speculative decoding settings (``speculative_config``), spelled as vLLM spells them.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
"prompt_lookup_max": b, "disable_by_batch_size": m}``: each step, a request that is
decoding proposes up to ``k`` draft tokens by prompt lookup (the longest n-gram,
``a <= n <= b``, that ends its tokens and occurred before in them; the tokens that
followed its latest occurrence) and verifies them as extra query tokens of the same
step. With more than ``disable_by_batch_size`` requests running, a step does not
speculate: verification costs little only while a step's weight reads dominate.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.engine.errors import JSONTextError
from pagedserve.engine.jsonlimits import decode_json

METHODS = ("ngram",)
DEFAULT_DISABLE_BY_BATCH_SIZE = 2
"""Running requests above which a step does not speculate: on the 2-core CPU host of
``BENCHMARKS.md`` ("Speculative decoding") verification paid at 1 and 2 concurrent
requests and cost 8-18% at 4 and more."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 2
    """Drafts per step: 2 measured best for the default model on the CPU (``BENCHMARKS.md``)."""
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, limit: str) -> ValueError:
            return ValueError(f"speculative_config {name}={value!r} is invalid: {limit}")

        if self.method not in METHODS:
            raise bad("method", self.method, f"must be one of {METHODS}")
        for name, low, high in (("num_speculative_tokens", 1, 16), ("prompt_lookup_min", 1, 64),
                                ("prompt_lookup_max", 1, 64),
                                ("disable_by_batch_size", 1, 1 << 20)):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
                raise bad(name, v, f"must be an integer in [{low}, {high}]")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", self.prompt_lookup_min,
                      f"must be <= prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON object string (the CLI's ``--speculative-config``), an
        instance or None. A lookup bound given alone keeps the other's default, moved
        to it where the default would be out of order."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = decode_json(value, "speculative_config")
            except JSONTextError as e:
                raise ValueError(str(e)) from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} is invalid: must be a dict "
                             "such as {\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        kw = dict(value)
        lo, hi = kw.get("prompt_lookup_min"), kw.get("prompt_lookup_max")
        defaults = {name: f.default for name, f in cls.__dataclass_fields__.items()}
        if isinstance(lo, int) and hi is None:
            kw["prompt_lookup_max"] = max(lo, defaults["prompt_lookup_max"])
        if isinstance(hi, int) and lo is None:
            kw["prompt_lookup_min"] = min(hi, defaults["prompt_lookup_min"])
        return cls(**kw)
