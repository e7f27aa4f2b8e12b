"""The store: non-blocking puts, prefix lookups, loads, demotion and promotion."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pagedserve.engine.kvstore import DiskTier, KVBlockStore, MemoryTier, open_store
from pagedserve.engine.kvstore.files import block_path
from tests.helpers.kvstore import FILE_BYTES, NBYTES, fingerprint, key, payload


def _disk(tmp_path: Path, blocks: int = 10) -> DiskTier:
    return DiskTier(tmp_path, blocks * FILE_BYTES, fingerprint(), NBYTES)


def _load(store: KVBlockStore, keys: list[bytes]) -> list:
    ticket = store.request_load(keys)
    assert ticket.wait(5)
    return ticket.payloads()


@pytest.mark.parametrize("read_threads", [1, 4])
def test_roundtrip_through_the_disk_and_a_restart(tmp_path: Path, read_threads: int) -> None:
    store = KVBlockStore([_disk(tmp_path)], NBYTES)
    chain = [key(i) for i in range(4)]
    for k in chain[:3]:
        assert store.put(k, payload(k))
    store.close()
    store = KVBlockStore([_disk(tmp_path)], NBYTES, read_threads=read_threads)
    assert store.longest_prefix(chain) == 3
    assert _load(store, chain[:3]) == [payload(k) for k in chain[:3]]
    stats = store.stats()
    assert stats["disk"]["loads"] == 3 and stats["disk"]["bytes_read"] == 3 * FILE_BYTES
    assert stats["store"]["blocks_loaded"] == 3 and stats["store"]["loads_cut_short"] == 0
    assert stats["store"]["lookups"] == 1 and stats["store"]["lookup_blocks"] == 3
    store.close()


def test_longest_prefix_stops_at_the_first_gap(tmp_path: Path) -> None:
    store = KVBlockStore([MemoryTier(10 * NBYTES)], NBYTES)
    for i in (0, 1, 3):
        store.put(key(i), payload(key(i)))
    store.flush()
    assert store.longest_prefix([key(i) for i in range(4)]) == 2
    assert store.longest_prefix([key(3), key(0)]) == 2
    assert store.longest_prefix([key(2), key(3)]) == 0
    assert store.longest_prefix([]) == 0
    store.close()


@pytest.mark.parametrize("read_threads", [1, 4])
def test_a_bad_block_cuts_the_load_short(tmp_path: Path, read_threads: int) -> None:
    store = KVBlockStore([_disk(tmp_path)], NBYTES, read_threads=read_threads)
    chain = [key(i) for i in range(4)]
    for k in chain:
        store.put(k, payload(k))
    store.flush()
    path = block_path(store.tiers[0].root, chain[2])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x04
    path.write_bytes(data)
    assert store.longest_prefix(chain) == 4
    assert _load(store, chain) == [payload(chain[0]), payload(chain[1])]
    assert store.longest_prefix(chain) == 2
    stats = store.stats()
    assert stats["store"]["loads_cut_short"] == 1 and stats["store"]["blocks_loaded"] == 2
    assert stats["disk"]["skips"]["corrupt"] == 1
    # The block past the broken one is dropped too (its request computes it again), so
    # storing it again writes a fresh file instead of touching the old one.
    assert stats["store"]["discarded"] == 1 and stats["disk"]["blocks"] == 2
    assert not block_path(store.tiers[0].root, chain[3]).exists()
    store.close()


class SlowTier(MemoryTier):
    """A memory tier whose puts wait for a gate."""

    def __init__(self) -> None:
        super().__init__(100 * NBYTES)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def put(self, key: bytes, payload):
        self.entered.set()
        assert self.gate.wait(10)
        return super().put(key, payload)


def test_put_never_blocks_and_drops_when_the_queue_is_full() -> None:
    tier = SlowTier()
    store = KVBlockStore([tier], NBYTES, max_queued_writes=2)
    assert store.put(key(0), payload(key(0)))
    assert tier.entered.wait(5)  # the writer holds block 0
    start = time.monotonic()
    results = [store.put(key(i), payload(key(i))) for i in range(1, 10)]
    assert time.monotonic() - start < 0.5
    assert results == [True, True] + [False] * 7
    assert not store.put(key(1), payload(key(1)))  # queued already
    assert store.longest_prefix([key(0), key(1), key(2), key(3)]) == 3
    assert _load(store, [key(1), key(2)]) == [payload(key(1)), payload(key(2))]
    stats = store.stats()["store"]
    assert (stats["puts"], stats["dropped_writes"], stats["duplicate_puts"]) == (3, 7, 1)
    assert stats["queued"] == 2 and stats["queued_hits"] == 2
    # The room left is what a caller reads before copying blocks out; what it leaves
    # out for want of room it counts.
    assert store.room() == 0
    store.drop(5)
    assert store.stats()["store"]["dropped_writes"] == 12
    tier.gate.set()
    assert store.flush(5)
    assert store.stats()["memory"]["writes"] == 3 and store.stats()["store"]["queued"] == 0
    assert store.room() == 2
    store.close()
    assert store.room() == 0


def test_memory_demotes_to_disk_and_a_disk_hit_is_promoted(tmp_path: Path) -> None:
    memory, disk = MemoryTier(2 * NBYTES), _disk(tmp_path)
    store = KVBlockStore([memory, disk], NBYTES)
    for i in range(3):
        store.put(key(i), payload(key(i)))
    store.flush()
    assert [memory.contains(key(i)) for i in range(3)] == [False, True, True]
    assert [disk.contains(key(i)) for i in range(3)] == [True, False, False]
    assert store.longest_prefix([key(0), key(1), key(2)]) == 3
    assert _load(store, [key(0)]) == [payload(key(0))]  # from disk, into memory
    store.flush()
    assert [memory.contains(key(i)) for i in range(3)] == [True, False, True]
    assert [disk.contains(key(i)) for i in range(3)] == [True, True, False]
    stats = store.stats()
    assert (stats["store"]["demotions"], stats["store"]["promotions"]) == (2, 1)
    assert (stats["memory"]["writes"], stats["memory"]["evictions"]) == (4, 2)
    assert stats["memory"]["bytes_used"] == 2 * NBYTES
    assert (stats["disk"]["writes"], stats["disk"]["loads"]) == (2, 1)
    assert stats["disk"]["bytes_written"] == 2 * FILE_BYTES
    assert _load(store, [key(2), key(0), key(1)]) == [payload(key(i)) for i in (2, 0, 1)]
    store.flush()
    # Demoting 2 again only marks its file used: it was written once.
    assert store.stats()["disk"]["writes"] == 3 and store.stats()["store"]["promotions"] == 2
    store.close()


def test_cancel_close_and_validation(tmp_path: Path) -> None:
    store = KVBlockStore([_disk(tmp_path)], NBYTES)
    with pytest.raises(ValueError):
        store.put(key(0), b"short")
    with pytest.raises(ValueError):
        store.put(b"", payload(key(0)))
    for i in range(5):
        store.put(key(i), payload(key(i)))
    store.close()  # writes what was queued
    assert len(list(tmp_path.rglob("*.kvb"))) == 5
    assert not store.put(key(9), payload(key(9)))
    ticket = store.request_load([key(0)])
    assert ticket.done() and ticket.payloads() == []
    store.close()
    cancelled = KVBlockStore([_disk(tmp_path)], NBYTES)
    ticket = cancelled.request_load([key(0)])
    ticket.cancel()
    assert ticket.wait(5) and len(ticket.payloads()) <= 1
    cancelled.close()


def test_open_store(tmp_path: Path) -> None:
    assert open_store(fingerprint(), NBYTES) is None
    store = open_store(fingerprint(), NBYTES, directory=tmp_path, disk_bytes=FILE_BYTES,
                       host_bytes=NBYTES)  # fmt: skip
    assert [t.name for t in store.tiers] == ["memory", "disk"]
    assert set(store.stats()) == {"store", "memory", "disk"}
    store.close()
    with pytest.raises(ValueError):
        KVBlockStore([MemoryTier(1), MemoryTier(2)], NBYTES)


def test_the_engine_copies_out_only_what_the_queue_takes() -> None:
    """Evicted blocks past the write queue's room are counted as dropped without their
    bytes being copied out of the cache; the most recently used (the last) are kept."""
    from pagedserve.engine.loop.store_link import EngineKVStore

    class Copier:
        block_nbytes = NBYTES

        def __init__(self) -> None:
            self.read_ids: list[int] = []

        def read(self, ids: list[int]) -> list[bytes]:
            self.read_ids += ids
            return [payload(key(b)) for b in ids]

    tier = SlowTier()
    store = KVBlockStore([tier], NBYTES, max_queued_writes=3)
    link = EngineKVStore(store, Copier(), 3)  # type: ignore[arg-type]
    link.put([(key(0), 0)])
    assert tier.entered.wait(5)  # the writer holds block 0: 3 places left
    link.put([(key(i), i) for i in range(1, 8)])
    assert link.copier.read_ids == [0, 5, 6, 7]
    assert store.stats()["store"]["dropped_writes"] == 4
    link.put([(key(9), 9)])  # no room: nothing read
    assert link.copier.read_ids == [0, 5, 6, 7]
    tier.gate.set()
    assert store.flush(5)
    assert store.longest_prefix([key(5), key(6), key(7)]) == 3
    store.close()
