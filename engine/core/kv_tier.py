"""The scheduler's side of the KV block store: the pool's lower tier, and loads as waits.

:class:`StoreTier` is the block manager's :class:`~pagedserve.blockmgr.lower_tier.LowerTier`
over a store (:class:`BlockStore`, which :class:`pagedserve.engine.kvstore.KVBlockStore`
is). It collects, for each step's :class:`~.scheduler_output.SchedulerOutput`, the blocks
whose KV bytes the engine copies between the pool and the store:

* ``blocks_to_save``: blocks the pool evicted while their bytes were intact (copied out
  before anything else of the step, so before the step reuses them);
* ``blocks_to_load``: blocks placed back in the pool from a finished load (copied in
  next, before the forward pass);
* ``blocks_to_write``: with write-through, the blocks the step computes in full (copied
  out after the forward pass).

A load never makes the step loop wait: a request whose chain goes on in the store leaves
the waiting queue for ``waiting_for_kv_load`` while the store's reader thread reads the
blocks, and joins the queue again once its ticket is done. At its next admission the
blocks read are placed in the pool as cached blocks, and the prefix lookup hits them as
it hits any cached block (a ticket that read fewer blocks than asked, or blocks evicted
since, leave the rest to be computed). A request loads at most once per admission, and
requests whose blocks one load in flight already reads (a shared system prompt after a
restart) wait for that load rather than read the blocks again.

Torch-free: payloads are opaque here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from pagedserve.blockmgr import KVCacheManager
from pagedserve.blockmgr.hashing import BlockHash
from pagedserve.engine.core.request import Request


class LoadTicket(Protocol):
    """A load in flight (:class:`pagedserve.engine.kvstore.LoadTicket`)."""

    keys: tuple[bytes, ...]
    """The keys asked for, in chain order."""

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def cancel(self) -> None: ...

    def payloads(self) -> list: ...


class BlockStore(Protocol):
    """What the scheduler asks of the store: index lookups and loads."""

    def longest_prefix(self, keys: Sequence[bytes]) -> int: ...

    def request_load(self, keys: Sequence[bytes]) -> LoadTicket: ...


@dataclass(slots=True)
class StoreTierStats:
    """Counters of the store as the scheduler uses it (blocks unless named otherwise)."""

    hits: int = 0
    """Blocks found in the store past a pool hit (each starts a load)."""
    loads: int = 0
    """Loads started."""
    shared: int = 0
    """Admissions that found blocks a load in flight already reads, and waited for it."""
    loaded: int = 0
    """Blocks the loads delivered (a shared load's, to each of its requests)."""
    placed: int = 0
    """Blocks read that went back into the pool (the rest were cached meanwhile, or
    found no free block)."""
    cut_short: int = 0
    """Blocks found that the load did not read (the engine computes them)."""
    saved: int = 0
    """Blocks the pool evicted and handed to the store."""
    written_through: int = 0
    """Blocks handed to the store as soon as a step computed them (write-through)."""

    def mark(self) -> tuple[int, ...]:
        """The counters as a tuple: a cheap test of whether any moved."""
        return tuple(getattr(self, name) for name in self.__slots__)


@dataclass(slots=True)
class _Load:
    """A load and the requests waiting for it."""

    ticket: LoadTicket
    first: int
    """The chain position of its first block."""
    users: int = 1


class StoreTier:
    """The pool's lower tier over ``store`` (see the module)."""

    def __init__(self, store: BlockStore, write_through: bool = False) -> None:
        self.store = store
        self.write_through = write_through
        self.stats = StoreTierStats()
        self._saves: list[tuple[BlockHash, int]] = []
        self._writes: list[tuple[BlockHash, int]] = []
        self._loads: list[tuple[BlockHash, int, object]] = []
        self._tickets: dict[str, tuple[_Load, int]] = {}
        """Per request: its load, and how many of the load's blocks are its own."""
        self._by_key: dict[BlockHash, _Load] = {}
        """Loads with requests waiting, by their first key (a load to share)."""
        self._tried: set[str] = set()
        """Requests that loaded since their latest admission."""

    # -- LowerTier ------------------------------------------------------------
    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        return self.store.longest_prefix(keys)

    def evicted(self, key: BlockHash, block_id: int) -> None:
        self._saves.append((key, block_id))
        self.stats.saved += 1

    def filled(self, key: BlockHash, block_id: int) -> bool:
        if not self.write_through:
            return False
        self._writes.append((key, block_id))
        self.stats.written_through += 1
        return True

    # -- loads ------------------------------------------------------------------
    def start_load(self, kv: KVCacheManager, req: Request, num_hit_blocks: int) -> bool:
        """Right after the request's pool lookup hit ``num_hit_blocks``: start reading
        the blocks of its chain the store holds past them; False when there are none (or
        the request loaded since its admission)."""
        rid = req.request_id
        if rid in self._tried:
            return False
        keys = kv.lower_tier_keys(req, num_hit_blocks)
        if not keys:
            return False
        self._tried.add(rid)
        load = self._by_key.get(keys[0])
        if load is not None and load.ticket.keys[:len(keys)] == tuple(keys):
            load.users += 1
            self.stats.shared += 1
        else:  # none, or one that reads fewer blocks: a load of its own, shared from now on
            load = self._by_key[keys[0]] = _Load(self.store.request_load(keys), num_hit_blocks)
            self.stats.loads += 1
        self._tickets[rid] = (load, len(keys))
        self.stats.hits += len(keys)
        return True

    def _leave(self, load: _Load) -> bool:
        """A request stops waiting for ``load``; True when it was the last one."""
        load.users -= 1
        if load.users:
            return False
        if self._by_key.get(load.ticket.keys[0]) is load:
            del self._by_key[load.ticket.keys[0]]
        return True

    def load_done(self, rid: str) -> bool:
        entry = self._tickets.get(rid)
        return entry is None or entry[0].ticket.done()

    def place(self, kv: KVCacheManager, req: Request) -> None:
        """Put the blocks the request's finished load read back in the pool (as cached
        free blocks, their bytes queued for this step's ``blocks_to_load``)."""
        entry = self._tickets.pop(req.request_id, None)
        if entry is None:
            return
        load, wanted = entry
        self._leave(load)
        first, payloads = load.first, load.ticket.payloads()[:wanted]
        self.stats.loaded += len(payloads)
        self.stats.cut_short += wanted - len(payloads)
        placed = kv.import_blocks(req, first, len(payloads))
        block_hash = kv.pool.block_hash
        for i, b in placed:
            self._loads.append((block_hash[b], b, payloads[i - first]))
        self.stats.placed += len(placed)

    def forget(self, rid: str) -> None:
        """The request finished or was preempted: cancel its load, and let it load again
        at a later admission."""
        entry = self._tickets.pop(rid, None)
        if entry is not None and self._leave(entry[0]):
            entry[0].ticket.cancel()
        self._tried.discard(rid)

    def tickets(self) -> list[LoadTicket]:
        return [load.ticket for load, _ in self._tickets.values()]

    # -- per step -----------------------------------------------------------------
    def take_saves(self) -> list[tuple[BlockHash, int]]:
        """The evicted blocks not yet handed to a step (their bytes are intact)."""
        saves, self._saves = self._saves, []
        return saves

    def take_transfers(self, kv: KVCacheManager) -> tuple[list, list, list]:
        """The step's ``(blocks_to_save, blocks_to_load, blocks_to_write)``; a placed
        block evicted again before its step has no load any more."""
        block_hash = kv.pool.block_hash
        loads = [(b, p) for key, b, p in self._loads if block_hash[b] == key]
        writes, self._writes, self._loads = self._writes, [], []
        return self.take_saves(), loads, writes

    def counters(self) -> dict[str, int]:
        return asdict(self.stats)
