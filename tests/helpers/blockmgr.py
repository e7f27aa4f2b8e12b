"""Fake engine requests for the block manager tests, and one step of allocation."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.blockmgr import KVCacheManager

BS = 4


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_key: str | None = None


def step(mgr: KVCacheManager, req: FakeRequest, num_new: int) -> bool:
    """Allocate for ``num_new`` tokens and, on success, mark them computed."""
    ok = mgr.allocate_slots(req, num_new)
    if ok:
        req.num_computed_tokens += num_new
    return ok
