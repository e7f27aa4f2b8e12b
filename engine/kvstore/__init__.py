"""A persistent, tiered store of full KV cache blocks, keyed by their prefix chain keys.

Torch-free: a payload is ``block_nbytes`` opaque bytes (the worker's copy of one block's
K and V across its layers). The modules, from the bottom:

* :mod:`.fingerprint`: everything that changes KV bytes, as one digest. A block is only
  ever read back under the fingerprint it was written under.
* :mod:`.files`: one block file (header with magic, version, fingerprint, key, lengths
  and checksums; payload), written atomically and verified in full when read.
* :mod:`.tiers`: the tier protocol, the counters and the host-memory tier.
* :mod:`.disk`: the disk tier (bounded, LRU across restarts, shareable between
  processes, switched off with one warning on an I/O error).
* :mod:`.store`: :class:`KVBlockStore`, the tiers behind a writer and a reader thread.

Guarantees: a block is served only if its file verifies (else it is skipped, counted,
logged and removed, and the engine recomputes it); the disk tier never holds more than
its capacity in this process's view and rescans to stay near it when several processes
share the directory; a process killed at any point leaves nothing a later start trusts
(at most a temporary file, removed by the next scan); ``put`` never blocks the engine.
"""

from __future__ import annotations

import os

from pagedserve.engine.kvstore.disk import DiskTier
from pagedserve.engine.kvstore.files import Payload, SkipReason
from pagedserve.engine.kvstore.fingerprint import (
    ENGINE_FIELDS,
    FORMAT_VERSION,
    StoreFingerprint,
)
from pagedserve.engine.kvstore.store import KVBlockStore, LoadTicket, StoreStats
from pagedserve.engine.kvstore.tiers import MemoryTier, Tier, TierStats

__all__ = ["ENGINE_FIELDS", "FORMAT_VERSION", "DiskTier", "KVBlockStore", "LoadTicket",
           "MemoryTier", "Payload", "SkipReason", "StoreFingerprint", "StoreStats", "Tier",
           "TierStats", "open_store"]  # fmt: skip


def open_store(fingerprint: StoreFingerprint, block_nbytes: int, *,
               directory: str | os.PathLike[str] | None = None, disk_bytes: int = 0,
               host_bytes: int = 0, max_queued_writes: int = 64,
               fsync: bool = False) -> KVBlockStore | None:  # fmt: skip
    """The store ``--kv-host-gb`` / ``--kv-store-dir`` / ``--kv-store-gb`` ask for: a host
    memory tier of ``host_bytes`` (if any) over a disk tier of ``disk_bytes`` in
    ``directory`` (if both are given); None when neither is. A disk tier that cannot be
    used is switched off with one warning, and the store serves from memory alone."""
    tiers: list[Tier] = []
    if host_bytes > 0:
        tiers.append(MemoryTier(host_bytes))
    if directory is not None and disk_bytes > 0:
        tiers.append(DiskTier(directory, disk_bytes, fingerprint, block_nbytes, fsync=fsync))
    if not tiers:
        return None
    return KVBlockStore(tiers, block_nbytes, max_queued_writes=max_queued_writes)
