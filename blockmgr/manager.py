"""KVCacheManager: block tables per request over a shared pool, with prefix caching.

Blocks hold ``block_size`` tokens each. A request's block table only grows (one block at a
time, never copied) until :meth:`KVCacheManager.free` releases it tail first. With prefix
caching on, every block that becomes full gets a chained key (see :mod:`pagedserve.blockmgr.hashing`)
and is registered in the cache as soon as it is allocated, so another request, even in the
same step, can hit it; a freed block keeps its key until it is taken for new use.

With sliding-window layers the model's layers form several KV groups
(:mod:`pagedserve.blockmgr.groups`), each with its own table over the one pool: a sliding
group's table gives back the blocks its window has left behind (the position keeps
:attr:`KVCacheManager.null_block`), and a prefix-cache hit counts only where every group
still holds what the first computed token reads.

A lower tier (:mod:`pagedserve.blockmgr.lower_tier`, the engine's KV block store) may
sit below the pool, for models of one KV group of full attention: it receives the blocks the pool evicts
and serves the blocks of a chain past the pool's hit, which the scheduler places back in
the pool with :meth:`KVCacheManager.import_blocks`.

All hot paths are O(1) per block and group: free-queue operations, dict lookups and one
blake2b call per full block.
"""

from __future__ import annotations

import logging

from pagedserve.blockmgr.block_pool import BlockPool
from pagedserve.blockmgr.groups import KVGroups
from pagedserve.blockmgr.hashing import (
    ROOT_HASH,
    BlockHash,
    block_extra_keys,
    group_key,
    hash_block_tokens,
)
from pagedserve.blockmgr.invariants import check_manager
from pagedserve.blockmgr.lower_tier import LowerTier, chain_from, import_blocks
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

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: KVGroups | None = None, lower_tier: LowerTier | None = None,
                 ) -> None:  # fmt: skip
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups if groups is not None else KVGroups((None,), ((),))
        self.windows = self.groups.windows
        if not 0 < len(self.windows) < 256:
            raise ValueError(f"1 to 255 KV groups, got {len(self.windows)}")
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"sliding windows must be positive, got {self.windows}")
        self.num_groups = len(self.windows)
        self._sliding = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        self.null_block = num_blocks
        """What a sliding group's table holds below its window: one past the pool."""
        self.pool = BlockPool(num_blocks)
        if lower_tier is not None and (self.num_groups > 1 or self._sliding
                                       or not enable_prefix_caching):  # fmt: skip
            raise ValueError("a lower KV tier needs prefix caching and one KV group of "
                             "full attention")
        self.lower_tier = lower_tier
        """The cache below the pool, or None (:mod:`pagedserve.blockmgr.lower_tier`)."""
        if lower_tier is not None:
            self.pool.on_spill = lower_tier.evicted
        self.requests: dict[str, RequestBlocks] = {}
        # The keys and per-group blocks of the latest lookup, reused by that request's
        # first allocation.
        self._last_lookup: tuple[str, list[BlockHash], list[list[int]]] | None = None
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
        computed (group 0's blocks; with several groups the others' are kept for the
        allocation). A hit of ``k`` blocks counts only if every full group holds all
        ``k`` and every sliding group the ones its window reads from token ``k *
        block_size`` on (positions below hold the null block). Takes no references: pass
        the blocks to :meth:`allocate_slots` right away. Counts the queried and hit
        tokens. Returns ``([], 0)`` when caching is off.
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
        if self.num_groups == 1 and not self._sliding:
            blocks: list[int] = []
            parent = ROOT_HASH
            for i in range(max_blocks):
                start = i * bs
                key = hash_block_tokens(parent, tokens[start:start + bs],
                                        block_extra_keys(salt, i, lora))  # fmt: skip
                hashes.append(key)
                b = cached.get(key)
                if b is None:
                    break
                blocks.append(b)
                parent = key
            per_group = [blocks]
        else:
            per_group = self._group_hit(req, max_blocks, hashes)
        num_hit = len(per_group[0]) * bs
        self.num_prefix_cache_queries += len(tokens)
        self.num_prefix_cache_hits += num_hit
        self._last_lookup = (rid, hashes, per_group)
        return per_group[0], num_hit

    def _group_hit(self, req: KVRequest, max_blocks: int,
                   hashes: list[BlockHash]) -> list[list[int]]:  # fmt: skip
        """Per group, the blocks of the longest hit every group can serve (see
        :meth:`get_computed_blocks`); appends the keys it computed to ``hashes``."""
        tokens, bs, cached = req.all_token_ids, self.block_size, self.pool.cached
        salt, lora = req.cache_salt, req.lora_key
        windows = self.windows
        full = [g for g, w in enumerate(windows) if w is None]
        found: list[list[int | None]] = [[] for _ in windows]
        num_full = max_blocks
        parent = ROOT_HASH
        for i in range(max_blocks):
            start = i * bs
            key = hash_block_tokens(parent, tokens[start:start + bs], block_extra_keys(salt, i, lora))
            if any(group_key(key, g) not in cached for g in full):
                num_full = i
                break
            hashes.append(key)
            for g in range(len(windows)):
                found[g].append(cached.get(group_key(key, g)))
            parent = key
        # Runs of consecutive cached blocks in each sliding group, ending at each position.
        runs = {}
        for g, _ in self._sliding:
            run, n = [], 0
            for b in found[g][:num_full]:
                n = n + 1 if b is not None else 0
                run.append(n)
            runs[g] = run
        k = num_full
        while k > 0 and not all(runs[g][k - 1] >= k - self._first_read(k, w)
                                for g, w in self._sliding):  # fmt: skip
            k -= 1
        null = self.null_block
        out = []
        for g, w in enumerate(windows):
            first = 0 if w is None else self._first_read(k, w)
            out.append([null] * first + [b for b in found[g][first:k]])  # type: ignore[misc]
        return out

    def _first_read(self, num_blocks: int, window: int) -> int:
        """The first block position a window of ``window`` tokens reads from the query at
        token ``num_blocks * block_size`` (the first token after a hit of that many)."""
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def lower_tier_keys(self, req: KVRequest, num_hit_blocks: int) -> list[BlockHash]:
        """Right after :meth:`get_computed_blocks` hit ``num_hit_blocks`` blocks: the keys
        of the blocks after them, in chain order, that the lower tier holds (at most up
        to the lookup's limit: the last token is always computed). Empty without a lower
        tier, or for a request with a LoRA adapter (see :mod:`.lower_tier`)."""
        if self.lower_tier is None or req.lora_key is not None:
            return []
        lookup = self._last_lookup
        known = lookup[1] if lookup is not None and lookup[0] == req.request_id else []
        max_blocks = max(len(req.all_token_ids) - 1, 0) // self.block_size
        if num_hit_blocks >= max_blocks:
            return []
        keys = chain_from(req, self.block_size, known, max_blocks)[num_hit_blocks:]
        return keys[:self.lower_tier.longest_prefix(keys)]

    def import_blocks(self, req: KVRequest, first: int, count: int) -> list[tuple[int, int]]:
        """Place blocks ``first .. first + count - 1`` of the request's chain, read from
        the lower tier, in the pool as cached free blocks (a lookup then hits them);
        returns ``(chain position, block id)`` of those placed, whose bytes the caller
        copies in before the next forward pass (see :func:`.lower_tier.import_blocks`)."""
        if self.lower_tier is None or count <= 0:
            return []
        self._last_lookup = None
        keys = chain_from(req, self.block_size, (), first + count)
        return import_blocks(self.pool, req, self.block_size, keys, first, count)

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
    def num_new_blocks_for(self, num_tokens: int, num_computed_blocks: int = 0) -> int:
        """Blocks a new request's first allocation of ``num_tokens`` tokens takes from
        the pool, ``num_computed_blocks`` of its positions a prefix-cache hit: a block per
        new position in every group's table."""
        return self.num_groups * (cdiv(num_tokens, self.block_size) - num_computed_blocks)

    def allocate_slots(
        self, req: KVRequest, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow the request's table to cover ``req.num_computed_tokens +
        len(new_computed_blocks) * block_size + num_new_tokens`` tokens.

        ``new_computed_blocks`` (from :meth:`get_computed_blocks`, first call only) get one
        reference each. New blocks come from the free-queue head, one per new position in
        every group's table. Sliding groups first give back the blocks their windows
        have left (also when the allocation then fails: no later step reads them).
        Without enough free blocks, returns False and changes nothing else. With caching
        on, registers the key of every block that is full once these tokens are computed.
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
            self._check_first_allocation(rid, num_before)
        elif state is not None and self._sliding:
            self._skip_left(state, req.num_computed_tokens)
        num_tokens = req.num_computed_tokens + len(computed) * bs + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens, bs) - num_before - len(computed))
        lookup = self._last_lookup if self._last_lookup is not None and \
            self._last_lookup[0] == rid else None  # fmt: skip
        group_computed = self._group_computed(req, computed, lookup) if computed else []
        if self.num_groups * num_new_blocks + self._num_revived(group_computed) > \
                pool.num_free_blocks:
            return False

        lookup_hashes = self._take_lookup(rid)
        if computed:
            if lookup_hashes is None or len(lookup_hashes) < len(computed):
                # Not from this request's latest lookup: rebuild the keys to validate.
                lookup_hashes = self._chain_keys(req, len(computed))
            self._validate_computed(rid, group_computed, lookup_hashes)
        if state is None:
            state = RequestBlocks(self.num_groups - 1)
            self.requests[rid] = state
        num_real = 0
        if computed:
            num_real = self._attach_computed(state, group_computed, lookup_hashes)
        elif lookup_hashes is not None and not state.block_hashes:
            state.block_hashes = lookup_hashes
        new_blocks = [pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
                      for _ in range(self.num_groups)]  # fmt: skip
        for st, blocks in zip(state.groups(), new_blocks, strict=True):
            st.block_ids.extend(blocks)
        self.num_slots_allocated += (num_real + self.num_groups * num_new_blocks) * bs
        # The positions the hit left null count as never filled.
        self.num_slots_filled -= (len(computed) * self.num_groups - num_real) * bs
        self._filled(req, state, num_tokens)
        if (computed or num_new_blocks) and logger.isEnabledFor(logging.DEBUG):
            self._log_allocation(rid, state, group_computed, new_blocks)
        return True

    def _num_revived(self, group_computed: list[list[int]]) -> int:
        """Hit blocks that are free now: taking them takes them from the free queue."""
        null, ref_counts = self.null_block, self.pool.ref_counts
        return sum(1 for blocks in group_computed for b in blocks
                   if b != null and ref_counts[b] == 0)  # fmt: skip

    def _log_allocation(self, rid: str, state: RequestBlocks, group_computed: list[list[int]],
                        new_blocks: list[list[int]]) -> None:  # fmt: skip
        one = self.num_groups == 1
        computed = (group_computed[0] if group_computed else []) if one else group_computed
        logger.debug("allocate %s: computed=%s new=%s -> %d blocks, %d tokens", rid, computed,
                     new_blocks[0] if one else new_blocks, len(state.block_ids),
                     state.num_tokens)  # fmt: skip

    def _check_first_allocation(self, rid: str, num_before: int) -> None:
        """Computed blocks come with caching on, to a request without blocks."""
        if not self.enable_prefix_caching:
            raise ValueError("new_computed_blocks given with prefix caching off")
        if num_before:
            raise ValueError(f"request {rid} already has blocks; computed blocks are for "
                             "its first allocation")

    def _attach_computed(self, state: RequestBlocks, group_computed: list[list[int]],
                         keys: list[BlockHash]) -> int:  # fmt: skip
        """A new table starts with the hit's blocks (one reference each) in every group;
        returns how many are real blocks (not null)."""
        null, num_real = self.null_block, 0
        for st, blocks in zip(state.groups(), group_computed, strict=True):
            real = [b for b in blocks if b != null]
            self.pool.touch(real)
            num_real += len(real)
            st.block_ids.extend(blocks)
            st.num_skipped = len(blocks) - len(real)
        state.num_hashed_blocks = len(group_computed[0])
        state.block_hashes = keys
        return num_real

    def _group_computed(self, req: KVRequest, computed: list[int],
                        lookup: tuple[str, list[BlockHash], list[list[int]]] | None,
                        ) -> list[list[int]]:  # fmt: skip
        """Every group's hit blocks for group 0's ``computed``: the latest lookup's, or
        (computed elsewhere) looked up again by key, an uncached one as the null block
        (which validation then rejects)."""
        if self.num_groups == 1:
            return [computed]
        k = len(computed)
        if lookup is not None and lookup[2][0][:k] == computed and len(lookup[2][0]) >= k:
            return [blocks[:k] for blocks in lookup[2]]
        keys = self._chain_keys(req, k)
        cached, null = self.pool.cached, self.null_block
        out = [computed]
        for g in range(1, self.num_groups):
            w = self.windows[g]
            first = 0 if w is None else self._first_read(k, w)
            out.append([null] * first + [cached.get(group_key(keys[i], g), null)
                                         for i in range(first, k)])
        return out

    def _skip_left(self, state: RequestBlocks, num_computed: int) -> None:
        """Give back, in every sliding group, the blocks below what the next query (token
        ``num_computed``) reads: their positions hold the null block from now on."""
        bs, null = self.block_size, self.null_block
        release = self.pool.release
        groups = state.groups()
        for g, w in self._sliding:
            st = groups[g]
            end = min(max(0, num_computed - w + 1) // bs, len(st.block_ids))
            first = st.num_skipped
            if end <= first:
                continue
            ids = st.block_ids
            gone = [b for b in ids[first:end] if b != null]
            ids[first:end] = [null] * (end - first)
            st.num_skipped = end
            release(reversed(gone))
            self.num_slots_allocated -= len(gone) * bs
            self.num_slots_filled -= (end - first) * bs

    def _fill_in_place(self, req: KVRequest, state: RequestBlocks, num_tokens: int) -> bool:
        """The decode fast path: True if the table already covers ``num_tokens``."""
        if num_tokens > len(state.block_ids) * self.block_size:
            return False
        if self._sliding:
            self._skip_left(state, req.num_computed_tokens)
        self._filled(req, state, num_tokens)
        return True

    def _filled(self, req: KVRequest, state: RequestBlocks, num_tokens: int) -> None:
        """The table's first ``num_tokens`` slots are (about to be) computed: count them,
        and key the blocks they fill. Also when the table does not grow: a request whose
        speculative tokens were rejected fills again slots it had asked for."""
        if num_tokens > state.num_tokens:
            self.num_slots_filled += (num_tokens - state.num_tokens) * self.num_groups
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

    def _validate_computed(self, rid: str, group_computed: list[list[int]],
                           keys: list[BlockHash]) -> None:  # fmt: skip
        """Reject computed blocks evicted or reused since the lookup that returned them."""
        block_hash, null = self.pool.block_hash, self.null_block
        for g, computed in enumerate(group_computed):
            for i, b in enumerate(computed):
                if b == null and self.windows[g] is not None:
                    continue
                if b == null or block_hash[b] != group_key(keys[i], g):
                    raise ValueError(f"request {rid}: computed block {b} (position {i}) is no "
                                     "longer cached under the looked-up key")

    def _hash_full_blocks(self, req: KVRequest, state: RequestBlocks, num_tokens: int) -> None:
        """Key and register the table's blocks that are full once its first
        ``num_tokens`` slots are computed (only the request's own tokens: speculative
        ones are not in ``all_token_ids`` and never enter the cache), in every group.

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
        tables = [st.block_ids for st in state.groups()]
        null = self.null_block
        salt, lora = req.cache_salt, req.lora_key
        lower = self.lower_tier if lora is None else None
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
            for g, blocks in enumerate(tables):
                b = blocks[i]
                gkey = group_key(key, g)
                if b != null and gkey not in cached and block_hash[b] is None:
                    pool.cache_block(b, gkey, (parent, chunk, extras),
                                     lower is not None and not lower.filled(gkey, b))
            parent = key
        state.num_hashed_blocks = num_full

    def fork(self, parent: KVRequest, child: KVRequest, num_tokens: int) -> int:
        """Share the parent's first ``num_tokens // block_size`` full blocks with a child
        that has no blocks yet (one more reference each, in every group). Returns the
        tokens shared: 0 when a sliding group of the parent has already given back a
        block the child's next token reads."""
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
        pgroups = pstate.groups()
        if any(pgroups[g].num_skipped > self._first_read(n, w) for g, w in self._sliding):
            return 0
        if cstate is None:
            cstate = RequestBlocks(self.num_groups - 1)
            self.requests[cid] = cstate
        null = self.null_block
        num_real = 0
        for pst, cst in zip(pgroups, cstate.groups(), strict=True):
            shared = pst.block_ids[:n]
            real = [b for b in shared if b != null]
            self.pool.touch(real)
            num_real += len(real)
            cst.block_ids = shared
            cst.num_skipped = min(pst.num_skipped, n)
        num_hashed = min(n, pstate.num_hashed_blocks)
        cstate.block_hashes = pstate.block_hashes[:num_hashed]
        cstate.num_hashed_blocks = num_hashed
        self.num_slots_allocated += num_real * bs
        self.num_slots_filled += num_real * bs - cstate.num_tokens * self.num_groups
        cstate.num_tokens = n * bs
        if self._last_lookup is not None and self._last_lookup[0] == cid:
            self._last_lookup = None
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("fork %s -> %s: shared %s", parent.request_id, cid,
                         [st.block_ids for st in cstate.groups()])  # fmt: skip
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
        null = self.null_block
        num_real = filled = 0
        for st in state.groups():
            blocks = [b for b in st.block_ids if b != null]
            if not keep_cached:
                self.pool.forget_keys(blocks)
            self.pool.release(reversed(blocks))
            num_real += len(blocks)
            filled += state.num_tokens - st.num_skipped * self.block_size
        self.num_slots_allocated -= num_real * self.block_size
        self.num_slots_filled -= filled
        if logger.isEnabledFor(logging.DEBUG):
            tables = [st.block_ids[::-1] for st in state.groups()]
            logger.debug("free %s: blocks %s", rid, tables[0] if len(tables) == 1 else tables)

    # -- queries ---------------------------------------------------------------------
    def get_block_table(self, request_id: str) -> list[int]:
        """The request's (group 0's) block table (a live, read-only view; empty if
        unknown)."""
        state = self.requests.get(request_id)
        return state.block_ids if state is not None else []

    def get_block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's block table (live, read-only views; empty tables if unknown)."""
        state = self.requests.get(request_id)
        if state is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple(st.block_ids for st in state.groups())

    def num_allocated_blocks(self, request_id: str) -> int:
        """Blocks of the pool the request's tables hold (0 if unknown)."""
        state = self.requests.get(request_id)
        if state is None:
            return 0
        return sum(len(st.block_ids) - st.num_skipped for st in state.groups())

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
