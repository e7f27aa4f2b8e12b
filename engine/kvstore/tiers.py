"""The store's tiers: what each must do, its counters, and the host-memory tier.

A tier maps block keys to payloads under a byte capacity, evicting its least recently
used blocks to make room. :class:`~.store.KVBlockStore` stacks tiers fastest first
(host memory, then disk): a block evicted from one tier is demoted into the next, and a
block read from a lower tier is promoted into the first.

Every method of a tier is thread-safe; ``contains`` is cheap (an index lookup) because
the engine's thread calls it while it schedules.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from pagedserve.engine.kvstore.files import Payload, SkipReason, payload_nbytes

Evicted = list[tuple[bytes, Payload]]
"""Blocks a put evicted, as ``(key, payload)``, for the next tier to take."""


@dataclass
class TierStats:
    """A tier's counters (each only grows, except ``blocks`` and ``bytes_used``). Bytes
    are counted as the tier holds them: the disk tier's include the file headers."""

    hits: int = 0
    """Lookups (``contains``) that found the key here."""
    misses: int = 0
    """Lookups that reached this tier and did not find the key."""
    loads: int = 0
    """Blocks read back (``get`` returned a payload)."""
    bytes_read: int = 0
    writes: int = 0
    """Blocks stored."""
    bytes_written: int = 0
    evictions: int = 0
    """Blocks removed to make room (demoted to the next tier, if any)."""
    bytes_evicted: int = 0
    errors: int = 0
    """I/O errors (a write error also switches a disk tier off)."""
    skips: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in SkipReason})
    """Blocks the index held that could not be served, by :class:`SkipReason` value (a
    key the tier does not hold is no skip)."""
    blocks: int = 0
    """Blocks held now (as this process's index knows them)."""
    bytes_used: int = 0
    enabled: int = 1
    """1 while the tier serves, 0 after an error switched it off."""

    def snapshot(self) -> dict[str, int | dict[str, int]]:
        """A copy, for :meth:`~.store.KVBlockStore.stats`."""
        return asdict(self)


class Tier(Protocol):
    """One level of the store."""

    name: str
    """``memory`` or ``disk``: the key of its counters."""
    capacity_bytes: int

    def contains(self, key: bytes) -> bool:
        """Whether the key is held (from the index: no I/O)."""
        ...

    def get(self, key: bytes) -> Payload | None:
        """The block's verified payload, or None (a miss, or a file skipped and counted);
        marks the block most recently used."""
        ...

    def put(self, key: bytes, payload: Payload) -> Evicted:
        """Store a block (the tier keeps ``payload``: the caller must not change it) and
        return the blocks evicted to make room. A block already held is only marked
        used."""
        ...

    def discard(self, keys: Sequence[bytes]) -> int:
        """Forget those of ``keys`` the tier holds (a disk tier removes their files);
        returns how many it held."""
        ...

    def stats(self) -> dict[str, int | dict[str, int]]:
        """A snapshot of the tier's :class:`TierStats`."""
        ...

    def close(self) -> None:
        """Release what the tier holds open (its contents stay where they persist)."""
        ...


class MemoryTier:
    """Blocks in host memory: an LRU ordered dict under a byte capacity.

    ``put`` keeps the payload object it is given (no copy); a block larger than the whole
    capacity is returned as evicted at once, so it goes straight to the next tier.
    """

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, Payload] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = TierStats()

    def contains(self, key: bytes) -> bool:
        with self._lock:
            found = key in self._blocks
            if found:
                self._stats.hits += 1
            else:
                self._stats.misses += 1
            return found

    def get(self, key: bytes) -> Payload | None:
        with self._lock:
            payload = self._blocks.get(key)
            if payload is None:
                return None
            self._blocks.move_to_end(key)
            self._stats.loads += 1
            self._stats.bytes_read += payload_nbytes(payload)
            return payload

    def put(self, key: bytes, payload: Payload) -> Evicted:
        size = payload_nbytes(payload)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return []
            if size > self.capacity_bytes:
                return [(key, payload)]
            evicted: Evicted = []
            while self._stats.bytes_used + size > self.capacity_bytes:
                old_key, old = self._blocks.popitem(last=False)
                old_size = payload_nbytes(old)
                self._account(-1, -old_size)
                self._stats.evictions += 1
                self._stats.bytes_evicted += old_size
                evicted.append((old_key, old))
            self._blocks[key] = payload
            self._account(1, size)
            self._stats.writes += 1
            self._stats.bytes_written += size
            return evicted

    def discard(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for key in keys:
                payload = self._blocks.pop(key, None)
                if payload is not None:
                    self._account(-1, -payload_nbytes(payload))
                    n += 1
        return n

    def blocks(self) -> list[tuple[bytes, Payload]]:
        """The blocks held, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._blocks.items())

    def _account(self, blocks: int, nbytes: int) -> None:
        self._stats.blocks += blocks
        self._stats.bytes_used += nbytes

    def stats(self) -> dict[str, int | dict[str, int]]:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._account(-self._stats.blocks, -self._stats.bytes_used)
