"""What the KV cache manager reads from an engine request."""

from __future__ import annotations

from typing import Protocol


class KVRequest(Protocol):
    """The attributes :class:`blockmgr.KVCacheManager` uses; it never writes to them.

    ``all_token_ids`` is the prompt plus the tokens generated so far (it only grows);
    ``num_computed_tokens`` counts tokens whose K/V are already in the cache.
    """

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    lora_key: str | None
    """The request's LoRA adapter (its blocks are cached apart from other adapters')."""
