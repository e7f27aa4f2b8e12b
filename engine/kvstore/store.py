"""The KV block store: tiers behind a writer thread and a reader thread (which reads a
load's blocks with a few helper threads: file reads and checksums leave the GIL, so they
overlap one another and keep several reads in flight on the disk).

What the engine supplies. A :class:`~.fingerprint.StoreFingerprint` of everything that
shapes the KV bytes, the payload size of one block (``block_nbytes``: one block's K and V
bytes across all layers, laid out as the fingerprint's ``layout`` says) and, per block,
its prefix chain key (:mod:`pagedserve.blockmgr.hashing`; keys of 1 to 64 bytes, so group
keys work too).

How the engine uses it. ``put`` a full block's key and payload when the block leaves the
pool (or as soon as it is full); it never blocks: the block is queued for the writer
thread, and dropped (counted) when the queue is full. To serve a prompt, find how many
leading keys of its chain the store holds with ``longest_prefix`` (index lookups, no
I/O), ``request_load`` those keys, poll ``ticket.done()`` between steps and then copy
``ticket.payloads()`` into free pool blocks. The loaded run may be shorter than asked
(a file found corrupt, evicted meanwhile, ...): the engine computes the rest.

Tiers are stacked fastest first. A put goes into the first tier; what a tier evicts is
demoted into the next; what the last evicts is gone. A block read from a lower tier is
promoted into the first (its evictions are demoted by the writer thread). Blocks queued
but not yet written are found by ``longest_prefix`` and served by loads all the same.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass

from pagedserve.engine.kvstore.files import MAX_KEY_BYTES, Payload, payload_nbytes
from pagedserve.engine.kvstore.tiers import Tier

logger = logging.getLogger("pagedserve.engine.kvstore")


@dataclass
class StoreStats:
    """The store's own counters (each tier has its own :class:`~.tiers.TierStats`)."""

    puts: int = 0
    """Blocks accepted by ``put``."""
    duplicate_puts: int = 0
    """Puts of a block already queued (ignored)."""
    dropped_writes: int = 0
    """Blocks not stored because the writer's queue was full (puts and demotions)."""
    demotions: int = 0
    """Blocks a tier evicted that the next tier took."""
    promotions: int = 0
    """Blocks read from a lower tier and copied into the first."""
    lookups: int = 0
    """``longest_prefix`` calls."""
    lookup_blocks: int = 0
    """Blocks those calls found."""
    load_requests: int = 0
    blocks_loaded: int = 0
    loads_cut_short: int = 0
    """Loads that ended before their last key (a block that could not be served)."""
    discarded: int = 0
    """Copies of blocks dropped from the tiers because their chain broke before them in a load
    (computed again by the request and stored afresh)."""
    queued_hits: int = 0
    """Blocks loaded from the write queue, before they reached a tier."""
    load_ns: int = 0
    """Time the reader thread spent on loads (reading and verifying their blocks)."""
    errors: int = 0
    """Unexpected failures of the threads' work (logged with their traceback)."""
    queued: int = 0
    """Writes waiting now."""


class LoadTicket:
    """A load in flight: ``done()`` says when ``payloads()`` may be taken."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys: tuple[bytes, ...] = tuple(keys)
        self._payloads: list[Payload] = []
        self._done = threading.Event()
        self._cancelled = False

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done (tests, shutdown); True when done."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop loading (the request went away); the ticket is done soon after."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def payloads(self) -> list[Payload]:
        """The payloads of the leading ``len(result)`` keys, each verified. They may be
        shared with the memory tier: read them, never change them."""
        if not self._done.is_set():
            raise RuntimeError("LoadTicket.payloads() before done()")
        return self._payloads

    def _finish(self) -> None:
        self._done.set()


_Write = tuple[bytes, Payload, int]
"""A queued write: key, payload, the index of the first tier to put it into."""


class KVBlockStore:
    """Tiers behind a bounded write queue and a load queue (see the module's docstring).

    Thread-safe; ``close()`` writes what is queued and joins the threads.
    """

    def __init__(self, tiers: Sequence[Tier], block_nbytes: int, *,
                 max_queued_writes: int = 64, read_threads: int = 4) -> None:  # fmt: skip
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"KV store tiers need distinct names, got {names}")
        self.tiers = list(tiers)
        self.block_nbytes = block_nbytes
        self._max_queued = max_queued_writes
        self._cond = threading.Condition()
        self._writes: deque[_Write] = deque()
        self._queued: dict[bytes, Payload] = {}
        self._writing = 0
        self._loads: deque[LoadTicket] = deque()
        self._loading = 0
        self._closing = False
        self._stats = StoreStats()
        self._threads = [threading.Thread(target=self._write_loop, name="kvstore-writer",
                                          daemon=True),
                         threading.Thread(target=self._read_loop, name="kvstore-reader",
                                          daemon=True)]  # fmt: skip
        self._readers = ThreadPoolExecutor(read_threads, "kvstore-read") \
            if read_threads > 1 else None  # fmt: skip
        for t in self._threads:
            t.start()

    def put(self, key: bytes, payload: Payload) -> bool:
        """Queue a full block for storing; never blocks. The store keeps ``payload`` (no
        copy): the caller must not change it afterwards. False when the block was not
        queued (already queued, queue full, store closed)."""
        if isinstance(payload, memoryview) and (payload.ndim != 1 or payload.format != "B"):
            payload = payload.cast("B")
        if payload_nbytes(payload) != self.block_nbytes or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"KV store block of {payload_nbytes(payload)} bytes keyed by "
                             f"{len(key)} bytes; the store takes {self.block_nbytes} bytes "
                             f"keyed by 1 to {MAX_KEY_BYTES}")  # fmt: skip
        with self._cond:
            if key in self._queued:
                self._stats.duplicate_puts += 1
                return False
            if not self._enqueue(key, payload, 0):
                return False
            self._stats.puts += 1
            return True

    def room(self) -> int:
        """Puts the write queue takes now before it drops."""
        with self._cond:
            return 0 if self._closing else max(0, self._max_queued - len(self._writes))

    def drop(self, n: int) -> None:
        """Count ``n`` blocks the caller did not put because the queue had no room (read
        :meth:`room` first: their bytes need not be copied out at all)."""
        with self._cond:
            self._stats.dropped_writes += n

    def _enqueue(self, key: bytes, payload: Payload, first_tier: int) -> bool:
        """Queue a write (the caller holds the condition)."""
        if self._closing or len(self._writes) >= self._max_queued:
            self._stats.dropped_writes += 1
            return False
        self._writes.append((key, payload, first_tier))
        self._queued[key] = payload
        self._cond.notify_all()
        return True

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of a chain some tier (or the write queue) holds. Index
        lookups only; a later load may still come back shorter."""
        found = 0
        for key in keys:
            with self._cond:
                queued = key in self._queued
            if not queued and not any(t.contains(key) for t in self.tiers):
                break
            found += 1
        with self._cond:
            self._stats.lookups += 1
            self._stats.lookup_blocks += found
        return found

    def request_load(self, keys: Sequence[bytes]) -> LoadTicket:
        """Start reading the blocks of ``keys`` (a chain's leading keys, in order) on the
        reader thread."""
        ticket = LoadTicket(keys)
        with self._cond:
            self._stats.load_requests += 1
            if self._closing:
                ticket._finish()
                return ticket
            self._loads.append(ticket)
            self._cond.notify_all()
        return ticket

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._writes and not self._closing:
                    self._cond.wait()
                if not self._writes:
                    return
                key, payload, first = self._writes.popleft()
                self._writing += 1
            try:
                self._store(key, payload, first)
            except Exception:
                logger.exception("KV store: storing a block failed")
                with self._cond:
                    self._stats.errors += 1
            finally:
                with self._cond:
                    if self._queued.get(key) is payload:
                        del self._queued[key]
                    self._writing -= 1
                    self._cond.notify_all()

    def _store(self, key: bytes, payload: Payload, first: int) -> None:
        """Put a block into tier ``first``, demoting what each tier evicts."""
        carry = [(key, payload)]
        for i in range(first, len(self.tiers)):
            if i > 0:
                with self._cond:
                    self._stats.demotions += len(carry)
            evicted = []
            for k, p in carry:
                evicted.extend(self.tiers[i].put(k, p))
            carry = evicted
            if not carry:
                return

    def _read_loop(self) -> None:
        while True:
            with self._cond:
                while not self._loads and not self._closing:
                    self._cond.wait()
                if not self._loads:
                    return
                ticket = self._loads.popleft()
                self._loading += 1
            try:
                self._load(ticket)
            except Exception:
                logger.exception("KV store: loading blocks failed")
                with self._cond:
                    self._stats.errors += 1
            finally:
                ticket._finish()
                with self._cond:
                    self._loading -= 1
                    self._cond.notify_all()

    def _load(self, ticket: LoadTicket) -> None:
        t0 = time.perf_counter_ns()
        keys = ticket.keys
        futures = [self._readers.submit(self._fetch_for, ticket, k) for k in keys] \
            if self._readers is not None and len(keys) > 1 else None  # fmt: skip
        broken = False
        try:
            for i, key in enumerate(keys):
                if ticket.cancelled or self._closing:
                    break
                payload = futures[i].result() if futures is not None else self._fetch(key)
                if payload is None:
                    broken = not (ticket.cancelled or self._closing)
                    break
                ticket._payloads.append(payload)
        finally:
            if futures is not None:  # none left running once the ticket is finished
                for f in futures:
                    f.cancel()
                wait(futures)
        discarded = 0
        if broken:
            # The request computes the rest of the chain and hands it over again; the
            # copies held past the broken block would only be touched, not replaced, by
            # that (a damaged file among them would be met again), so they go now.
            rest = keys[len(ticket._payloads) + 1:]
            discarded = sum(tier.discard(rest) for tier in self.tiers)
        with self._cond:
            self._stats.blocks_loaded += len(ticket._payloads)
            self._stats.discarded += discarded
            self._stats.load_ns += time.perf_counter_ns() - t0
            if len(ticket._payloads) < len(keys):
                self._stats.loads_cut_short += 1

    def _fetch_for(self, ticket: LoadTicket, key: bytes) -> Payload | None:
        """:meth:`_fetch` on a helper thread, unless the load was given up meanwhile."""
        if ticket.cancelled or self._closing:
            return None
        return self._fetch(key)

    def _fetch(self, key: bytes) -> Payload | None:
        """One block from the write queue or the first tier that serves it; a block from a
        lower tier is promoted into the first."""
        with self._cond:
            payload = self._queued.get(key)
            if payload is not None:
                self._stats.queued_hits += 1
                return payload
        for i, tier in enumerate(self.tiers):
            payload = tier.get(key)
            if payload is None:
                continue
            if i > 0:
                evicted = self.tiers[0].put(key, payload)
                with self._cond:
                    self._stats.promotions += 1
                    for k, p in evicted:
                        if k not in self._queued:
                            self._enqueue(k, p, 1)
            return payload
        return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write and requested load is done; True if they are."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._writes or self._writing
                                                    or self._loads or self._loading),
                                       timeout)  # fmt: skip

    def write_back(self) -> int:
        """Copy the blocks of the host-memory tiers into the last tier, where it lacks
        them (a memory tier does not outlive the process: at shutdown, so that a restart
        finds them), least recently used first; returns how many. Waits for the queued
        writes first; the last tier may evict older blocks to take them."""
        self.flush()
        last = self.tiers[-1]
        n = 0
        for tier in self.tiers[:-1]:
            blocks = getattr(tier, "blocks", None)
            for key, payload in blocks() if blocks is not None else ():
                if not last.contains(key):
                    last.put(key, payload)
                    n += 1
        return n

    def close(self) -> None:
        """Finish the queued writes, end the loads (cut short), join the threads, close
        the tiers. Idempotent."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        if self._readers is not None:
            self._readers.shutdown()
        for ticket in self._loads:
            ticket._finish()
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict[str, dict[str, int | dict[str, int]]]:
        """Counters: ``store`` (:class:`StoreStats`) and one entry per tier by its name
        (:class:`~.tiers.TierStats`)."""
        with self._cond:
            self._stats.queued = len(self._writes)
            out: dict[str, dict[str, int | dict[str, int]]] = {"store": asdict(self._stats)}
        for tier in self.tiers:
            out[tier.name] = tier.stats()
        return out
