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

    With several KV groups (:mod:`pagedserve.blockmgr.groups`) this is group 0's table and
    ``others`` holds the other groups' (the same length, the same keys); in a sliding
    group's table the first ``num_skipped`` positions hold the null block (the window
    has left them) and the rest real blocks.
    """

    __slots__ = ("block_ids", "block_hashes", "num_hashed_blocks", "num_tokens",
                 "num_skipped", "others")

    def __init__(self, num_others: int = 0) -> None:
        self.block_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []
        self.num_hashed_blocks = 0
        self.num_tokens = 0
        self.num_skipped = 0
        self.others: tuple[RequestBlocks, ...] = tuple(RequestBlocks() for _ in range(num_others))

    def groups(self) -> tuple[RequestBlocks, ...]:
        """Every group's table, group 0 first."""
        return (self, *self.others)
