"""The hook between the pool and a slower cache below it (the engine's KV block store).

The block manager stays pure Python and imports only itself: it knows the lower tier as
:class:`LowerTier`, a protocol of three calls, and hands it chain keys and block ids,
never KV bytes (the engine copies those, between steps).

What the pool promises the tier:

* :meth:`LowerTier.evicted` is called for a cached block that is taken for new use (or
  dropped by :meth:`~pagedserve.blockmgr.KVCacheManager.reset_prefix_cache`) while its KV
  bytes are still intact: nothing has written to the block since it was computed, and
  nothing writes to it before the engine's next forward pass. Keys dropped because their
  bytes are not trusted (a failed step, an errored request) are never handed over.
* :meth:`LowerTier.filled` is called when a block is keyed, that is when the step about
  to run computes it; a tier that takes the block then (write-through) copies it after
  that step, and is not handed the block again at its eviction.
* Only blocks of requests without a LoRA adapter reach the tier: an adapter enters the
  chain as its ``cache_key`` (id, name, path), which names no content and may mean other
  weights after a restart, so such blocks stay in the pool alone.
* Blocks read from the tier and placed back in the pool (:func:`import_blocks`) are not
  handed over again: the tier holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedserve.blockmgr.block_pool import BlockPool
from pagedserve.blockmgr.hashing import ROOT_HASH, BlockHash, block_extra_keys, hash_block_tokens
from pagedserve.blockmgr.protocol import KVRequest


class LowerTier(Protocol):
    """A cache of full blocks below the pool, keyed by the same chain keys."""

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` the tier holds (an index lookup, no I/O)."""
        ...

    def evicted(self, key: BlockHash, block_id: int) -> None:
        """The block leaves the pool with its KV bytes intact (see the module)."""
        ...

    def filled(self, key: BlockHash, block_id: int) -> bool:
        """The block is keyed and computed by the coming step; True when the tier takes
        it after that step (then it is not handed over at its eviction)."""
        ...


def chain_from(req: KVRequest, block_size: int, known: Sequence[BlockHash],
               num_blocks: int) -> list[BlockHash]:  # fmt: skip
    """The keys of the request's first ``num_blocks`` blocks, reusing the leading
    ``known`` ones (a lookup's) and hashing the rest."""
    keys = list(known[:num_blocks])
    tokens, salt, lora = req.all_token_ids, req.cache_salt, req.lora_key
    parent = keys[-1] if keys else ROOT_HASH
    for i in range(len(keys), num_blocks):
        start = i * block_size
        parent = hash_block_tokens(parent, tokens[start:start + block_size],
                                   block_extra_keys(salt, i, lora))  # fmt: skip
        keys.append(parent)
    return keys


def import_blocks(pool: BlockPool, req: KVRequest, block_size: int,
                  keys: Sequence[BlockHash], first: int, count: int) -> list[tuple[int, int]]:  # fmt: skip
    """Place blocks ``first .. first + count - 1`` of the request's chain (``keys`` holds
    at least that many) in the pool as cached free blocks, so a prefix lookup finds them;
    their bytes come from the lower tier and the caller copies them in before the next
    forward pass. Keys the pool holds already are skipped; at most as many blocks as are
    free are taken, and never a block of the chain itself (the pool hit the placed blocks
    extend). The chain's free blocks, placed or held, then go to the free queue's tail
    last block first, so the chain is evicted from its end. Returns ``(chain position,
    block id)`` of each block placed. The placed blocks do not spill (the lower tier
    holds them)."""
    tokens, salt, lora = req.all_token_ids, req.cache_salt, req.lora_key
    end = first + count
    chain = [(i, b) for i, k in enumerate(keys[:end])
             if (b := pool.cached.get(k)) is not None and pool.ref_counts[b] == 0]  # fmt: skip
    pool.touch(b for _, b in chain)  # out of the free queue while blocks are taken
    placed: list[tuple[int, int]] = []
    budget = pool.num_free_blocks
    for i in range(first, end):
        key = keys[i]
        if key in pool.cached:
            continue
        if len(placed) >= budget:
            break
        (b,) = pool.get_new_blocks(1)
        start = i * block_size
        parent = keys[i - 1] if i else ROOT_HASH
        pool.cache_block(b, key, (parent, tokens[start:start + block_size],
                                  block_extra_keys(salt, i, lora)), loaded=True)  # fmt: skip
        placed.append((i, b))
    pool.release(b for _, b in sorted(chain + placed, reverse=True))
    return placed
