"""Per-request block table and hash chain, kept inside the manager."""

from __future__ import annotations

from pagedserve.blockmgr.hashing import BlockHash


class RequestBlocks:
    """One request's view of the KV cache.

    Invariants: ``block_ids`` has no duplicates and only grows (by appending) until the
    request is freed; ``num_hashed_blocks <= len(block_ids)`` and
    ``num_hashed_blocks <= len(block_hashes)``; ``block_hashes[i]`` is the chained key of
    block ``i``'s tokens (it may run ahead of the table: keys computed by a prefix-cache
    lookup for blocks not allocated yet); blocks ``< num_hashed_blocks`` have been offered
    to the prefix cache; ``block_ids[i]``, if cached, is cached under ``block_hashes[i]``;
    ``num_tokens`` is the most tokens any allocation asked the table to hold.
    """

    __slots__ = ("block_ids", "block_hashes", "num_hashed_blocks", "num_tokens")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []
        self.num_hashed_blocks = 0
        self.num_tokens = 0
