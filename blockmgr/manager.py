"""KVCacheManager: block tables per request over a shared pool, with prefix caching.

Blocks hold ``block_size`` tokens each. A request's block table only grows (one block at a
time, never copied) until :meth:`KVCacheManager.free` releases it tail first. With prefix
caching on, every block that becomes full gets a chained key (see :mod:`pagedserve.blockmgr.hashing`)
and is registered in the cache as soon as it is allocated, so another request, even in the
same step, can hit it; a freed block keeps its key until it is taken for new use.

All hot paths are O(1) per block: free-queue operations, dict lookups and one blake2b call
per full block.
"""

from __future__ import annotations

import logging

from pagedserve.blockmgr.block_pool import BlockPool
from pagedserve.blockmgr.hashing import ROOT_HASH, BlockHash, block_extra_keys, hash_block_tokens
from pagedserve.blockmgr.invariants import check_manager
from pagedserve.blockmgr.protocol import KVRequest
from pagedserve.blockmgr.request_state import RequestBlocks
from pagedserve.blockmgr.stats import KVCacheStats
from pagedserve.blockmgr.util import cdiv

logger = logging.getLogger("pagedserve.blockmgr")


class KVCacheManager:
    """Allocates KV cache blocks to requests and serves prefix-cache hits.

    Requests are keyed by ``req.request_id``; the manager keeps each one's block table and
    hash chain until :meth:`free`. See :mod:`pagedserve.blockmgr.invariants` for what
    :meth:`check_invariants` verifies.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.requests: dict[str, RequestBlocks] = {}
        # Keys computed by the latest lookup, reused by that request's first allocation.
        self._last_lookup: tuple[str, list[BlockHash]] | None = None
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0
        self.num_slots_allocated = 0
        self.num_slots_filled = 0

    # -- occupancy -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, including cached-but-free ones."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks with ref count > 0, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    # -- prefix cache ----------------------------------------------------------------
    def get_computed_blocks(self, req: KVRequest) -> tuple[list[int], int]:
        """Longest run of cached full blocks matching the request's tokens.

        For a request with no blocks yet. Returns ``(block_ids, num_tokens)``, at most
        ``(len(req.all_token_ids) - 1) // block_size`` blocks so the last token is always
        computed. Takes no references: pass the blocks to :meth:`allocate_slots` right away.
        Counts the queried and hit tokens. Returns ``([], 0)`` when caching is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        rid = req.request_id
        state = self.requests.get(rid)
        if state is not None and state.block_ids:
            raise ValueError(f"request {rid} already has blocks; lookup is for new requests")
        tokens = req.all_token_ids
        bs = self.block_size
        salt, lora = req.cache_salt, req.lora_key
        cached = self.pool.cached
        max_blocks = max(len(tokens) - 1, 0) // bs
        hashes: list[BlockHash] = []
        blocks: list[int] = []
        parent = ROOT_HASH
        for i in range(max_blocks):
            start = i * bs
            key = hash_block_tokens(parent, tokens[start:start + bs], block_extra_keys(salt, i, lora))
            hashes.append(key)
            b = cached.get(key)
            if b is None:
                break
            blocks.append(b)
            parent = key
        num_hit = len(blocks) * bs
        self.num_prefix_cache_queries += len(tokens)
        self.num_prefix_cache_hits += num_hit
        self._last_lookup = (rid, hashes)
        return blocks, num_hit

    def reset_prefix_cache(self) -> bool:
        """Drop every cached key. False, and nothing changed, if any block is referenced."""
        if not self.pool.reset_prefix_cache():
            return False
        self._last_lookup = None
        logger.debug("prefix cache reset")
        return True

    def drop_unreferenced_cache(self) -> int:
        """Forget the keys of every free block, e.g. after a failed step whose blocks were
        registered but never written. Blocks still referenced keep theirs."""
        self._last_lookup = None
        n = self.pool.evict_unreferenced()
        logger.debug("dropped %d unreferenced cached blocks", n)
        return n

    # -- allocation ------------------------------------------------------------------
    def allocate_slots(
        self, req: KVRequest, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow the request's table to cover ``req.num_computed_tokens +
        len(new_computed_blocks) * block_size + num_new_tokens`` tokens.

        ``new_computed_blocks`` (from :meth:`get_computed_blocks`, first call only) get one
        reference each. New blocks come from the free-queue head. Without enough free blocks,
        returns False and changes nothing. With caching on, registers the key of every block
        that is full once these tokens are computed.
        """
        rid = req.request_id
        state = self.requests.get(rid)
        if state is not None and not new_computed_blocks and \
                self._fill_in_place(req, state, req.num_computed_tokens + num_new_tokens):
            return True
        bs = self.block_size
        pool = self.pool
        computed = new_computed_blocks or []
        num_before = len(state.block_ids) if state is not None else 0
        if computed:
            if not self.enable_prefix_caching:
                raise ValueError("new_computed_blocks given with prefix caching off")
            if num_before:
                raise ValueError(f"request {rid} already has blocks; computed blocks are for "
                                 "its first allocation")
        num_tokens = req.num_computed_tokens + len(computed) * bs + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens, bs) - num_before - len(computed))
        ref_counts = pool.ref_counts
        num_revived = sum(1 for b in computed if ref_counts[b] == 0) if computed else 0
        if num_new_blocks + num_revived > pool.num_free_blocks:
            return False

        lookup_hashes = self._take_lookup(rid)
        if computed:
            if lookup_hashes is None or len(lookup_hashes) < len(computed):
                # Not from this request's latest lookup: rebuild the keys to validate.
                lookup_hashes = self._chain_keys(req, len(computed))
            self._validate_computed(rid, computed, lookup_hashes)

        if state is None:
            state = RequestBlocks()
            self.requests[rid] = state
        if computed:
            pool.touch(computed)
            state.block_ids.extend(computed)
            state.num_hashed_blocks = len(computed)
            state.block_hashes = lookup_hashes
        elif lookup_hashes is not None and not state.block_hashes:
            state.block_hashes = lookup_hashes
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        state.block_ids.extend(new_blocks)
        self.num_slots_allocated += (len(computed) + num_new_blocks) * bs
        self._filled(req, state, num_tokens)
        if (computed or new_blocks) and logger.isEnabledFor(logging.DEBUG):
            logger.debug("allocate %s: computed=%s new=%s -> %d blocks, %d tokens",
                         rid, computed, new_blocks, len(state.block_ids), state.num_tokens)
        return True

    def _fill_in_place(self, req: KVRequest, state: RequestBlocks, num_tokens: int) -> bool:
        """The decode fast path: True if the table already covers ``num_tokens``."""
        if num_tokens > len(state.block_ids) * self.block_size:
            return False
        self._filled(req, state, num_tokens)
        return True

    def _filled(self, req: KVRequest, state: RequestBlocks, num_tokens: int) -> None:
        """The table's first ``num_tokens`` slots are (about to be) computed: count them,
        and key the blocks they fill. Also when the table does not grow: a request whose
        speculative tokens were rejected fills again slots it had asked for."""
        if num_tokens > state.num_tokens:
            self.num_slots_filled += num_tokens - state.num_tokens
            state.num_tokens = num_tokens
        if (self.enable_prefix_caching and min(num_tokens, len(req.all_token_ids))
                // self.block_size > state.num_hashed_blocks):
            self._hash_full_blocks(req, state, num_tokens)

    def _take_lookup(self, rid: str) -> list[BlockHash] | None:
        """The keys of ``rid``'s latest prefix-cache lookup, once."""
        lookup = self._last_lookup
        if lookup is None or lookup[0] != rid:
            return None
        self._last_lookup = None
        return lookup[1]

    def _chain_keys(self, req: KVRequest, num_blocks: int) -> list[BlockHash]:
        """Keys of the request's first ``num_blocks`` blocks, from its tokens."""
        bs = self.block_size
        tokens = req.all_token_ids
        keys: list[BlockHash] = []
        parent = ROOT_HASH
        for i in range(num_blocks):
            start = i * bs
            parent = hash_block_tokens(parent, tokens[start:start + bs],
                                       block_extra_keys(req.cache_salt, i, req.lora_key))
            keys.append(parent)
        return keys

    def _validate_computed(self, rid: str, computed: list[int], keys: list[BlockHash]) -> None:
        """Reject computed blocks evicted or reused since the lookup that returned them."""
        block_hash = self.pool.block_hash
        for i, b in enumerate(computed):
            if block_hash[b] != keys[i]:
                raise ValueError(f"request {rid}: computed block {b} (position {i}) is no longer "
                                 "cached under the looked-up key")

    def _hash_full_blocks(self, req: KVRequest, state: RequestBlocks, num_tokens: int) -> None:
        """Key and register the table's blocks that are full once its first
        ``num_tokens`` slots are computed (only the request's own tokens: speculative
        ones are not in ``all_token_ids`` and never enter the cache).

        Incremental: starts after ``state.num_hashed_blocks``; reuses keys already in
        ``state.block_hashes``.
        """
        bs = self.block_size
        tokens = req.all_token_ids
        num_full = min(num_tokens, len(tokens)) // bs
        first = state.num_hashed_blocks
        if first >= num_full:
            return
        pool = self.pool
        cached = pool.cached
        block_hash = pool.block_hash
        hashes = state.block_hashes
        blocks = state.block_ids
        salt, lora = req.cache_salt, req.lora_key
        parent = hashes[first - 1] if first else ROOT_HASH
        for i in range(first, num_full):
            start = i * bs
            chunk = tokens[start:start + bs]
            extras = block_extra_keys(salt, i, lora)
            if i < len(hashes):
                key = hashes[i]
            else:
                key = hash_block_tokens(parent, chunk, extras)
                hashes.append(key)
            b = blocks[i]
            if key not in cached and block_hash[b] is None:
                pool.cache_block(b, key, (parent, chunk, extras))
            parent = key
        state.num_hashed_blocks = num_full

    def fork(self, parent: KVRequest, child: KVRequest, num_tokens: int) -> int:
        """Share the parent's first ``num_tokens // block_size`` full blocks with a child
        that has no blocks yet (one more reference each). Returns the tokens shared."""
        cid = child.request_id
        cstate = self.requests.get(cid)
        if cstate is not None and cstate.block_ids:
            raise ValueError(f"fork target {cid} already has blocks")
        pstate = self.requests.get(parent.request_id)
        if pstate is None:
            return 0
        bs = self.block_size
        n = min(num_tokens, pstate.num_tokens) // bs
        if n <= 0:
            return 0
        shared = pstate.block_ids[:n]
        self.pool.touch(shared)
        if cstate is None:
            cstate = RequestBlocks()
            self.requests[cid] = cstate
        cstate.block_ids = shared
        num_hashed = min(n, pstate.num_hashed_blocks)
        cstate.block_hashes = pstate.block_hashes[:num_hashed]
        cstate.num_hashed_blocks = num_hashed
        self.num_slots_allocated += n * bs
        self.num_slots_filled += n * bs - cstate.num_tokens
        cstate.num_tokens = n * bs
        if self._last_lookup is not None and self._last_lookup[0] == cid:
            self._last_lookup = None
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("fork %s -> %s: shared %s", parent.request_id, cid, shared)
        return n * bs

    def free(self, req: KVRequest, *, keep_cached: bool = True) -> None:
        """Release all the request's blocks, tail first; no-op for an unknown request.

        A block whose ref count drops to 0 goes to the free-queue tail and keeps its key
        (stays hittable) until it is taken for new use. With ``keep_cached=False`` (a
        request whose KV is not trusted) the blocks no other table holds lose their keys
        first: no later request hits them.
        """
        rid = req.request_id
        if self._last_lookup is not None and self._last_lookup[0] == rid:
            self._last_lookup = None
        state = self.requests.pop(rid, None)
        if state is None:
            return
        blocks = state.block_ids
        if not keep_cached:
            self.pool.forget_keys(blocks)
        self.pool.release(reversed(blocks))
        self.num_slots_allocated -= len(blocks) * self.block_size
        self.num_slots_filled -= state.num_tokens
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("free %s: blocks %s", rid, blocks[::-1])

    # -- queries ---------------------------------------------------------------------
    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block table (a live, read-only view; empty if unknown)."""
        state = self.requests.get(request_id)
        return state.block_ids if state is not None else []

    def num_allocated_blocks(self, request_id: str) -> int:
        """Number of blocks in the request's table (0 if unknown)."""
        state = self.requests.get(request_id)
        return len(state.block_ids) if state is not None else 0

    def stats(self) -> KVCacheStats:
        """A snapshot of occupancy and prefix-cache counters."""
        num_free = self.pool.num_free_blocks
        allocated = self.num_slots_allocated
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=num_free,
            num_used_blocks=self.num_blocks - num_free,
            usage=self.usage,
            num_cached_blocks=len(self.pool.cached),
            prefix_cache_queries=self.num_prefix_cache_queries,
            prefix_cache_hits=self.num_prefix_cache_hits,
            num_slots_allocated=allocated,
            num_slots_filled=self.num_slots_filled,
            waste=1.0 - self.num_slots_filled / allocated if allocated else 0.0,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError, naming the broken invariant, if the state is inconsistent."""
        check_manager(self)
