"""Snapshot of KV cache counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KVCacheStats:
    """KV cache occupancy and prefix-cache counters at one moment.

    ``prefix_cache_queries`` and ``prefix_cache_hits`` count tokens (cumulative).
    ``num_slots_allocated`` / ``num_slots_filled`` sum over live requests the token slots of
    their block tables and the tokens those tables are asked to hold (a block shared by two
    requests counts for each); ``waste = 1 - filled / allocated`` (0 with no live request).
    """

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    usage: float
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_slots_allocated: int
    num_slots_filled: int
    waste: float

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the prefix cache."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
