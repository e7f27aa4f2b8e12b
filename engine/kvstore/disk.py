"""The disk tier: block files in a directory, bounded in bytes, LRU across restarts.

Index. The tier keeps an in-memory index of its fingerprint directory (key -> file size,
least recently used first), built by a scan when it opens: file modification times are
the last-use times (a ``get`` and a repeated ``put`` stamp the file), so the order, and
with it the eviction order, survives a restart. The scan also removes the temporary files
of writers that are gone (their pid no longer runs, or the file is older than
``stale_temp_s``) and evicts down to the capacity, which may have shrunk since.

Bound. A put first evicts least recently used files until the new file fits in
``capacity_bytes``, so this process's index never holds more. Other processes sharing
the directory (data-parallel replicas, a second server) are not in the index; every
``rescan_every_bytes`` written (an eighth of the capacity by default) the tier rescans the
directory, adopts what it finds and evicts down to the capacity again, so the directory
overshoots by at most about that much per writing process. A file another process
removed is a miss (:attr:`SkipReason.MISSING`), not an error; ``contains`` also finds a
block another process wrote since the scan (one ``stat`` per lookup that misses the index).

Errors. A write, a directory that cannot be created or scanned, or a removal failing
with an ``OSError`` (disk full, permission denied, read-only file system, ...) switches
the tier off: one warning, ``errors`` and ``enabled`` in its counters, and from then on
it holds nothing, so the store serves from its other tiers. A read error is counted and is
a miss. A file that fails verification is counted under its reason, logged and removed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from pagedserve.engine.kvstore.files import (
    TEMP_PREFIX,
    Payload,
    SkipReason,
    block_path,
    file_size,
    fingerprint_dir,
    key_of,
    payload_nbytes,
    read_block,
    temp_owner,
    write_block,
)
from pagedserve.engine.kvstore.fingerprint import StoreFingerprint
from pagedserve.engine.kvstore.tiers import Evicted, TierStats

logger = logging.getLogger("pagedserve.engine.kvstore")

STALE_TEMP_S = 300.0
"""A temporary file older than this is a dead writer's, whatever its pid says (pids are
reused, and differ between containers sharing a directory)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def scan_directory(root: Path, stale_temp_s: float = STALE_TEMP_S) -> OrderedDict[bytes, int]:
    """Block files under fingerprint directory ``root`` as ``key -> size``, least recently
    used first; removes dead writers' temporary files on the way."""
    found: list[tuple[int, bytes, int]] = []
    now = time.time()
    try:
        subs = list(os.scandir(root))
    except FileNotFoundError:  # removed from outside: writes create it again
        return OrderedDict()
    for sub in subs:
        if not sub.is_dir(follow_symlinks=False):
            continue
        try:
            entries = list(os.scandir(sub.path))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if entry.name.startswith(TEMP_PREFIX):
                    pid = temp_owner(entry.name)
                    if pid is None or not _pid_alive(pid) or now - st.st_mtime > stale_temp_s:
                        os.unlink(entry.path)
                    continue
            except FileNotFoundError:
                continue
            key = key_of(entry.name)
            if key is not None and entry.is_file(follow_symlinks=False):
                found.append((st.st_mtime_ns, key, st.st_size))
    found.sort()
    return OrderedDict((key, size) for _, key, size in found)


class DiskTier:
    """Blocks of one fingerprint under ``directory`` (see the module's docstring).

    ``block_nbytes`` is the payload size of every block; ``fsync`` makes each file
    durable against a power loss before it is published (slower; a killed process needs
    no fsync).
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int,
                 fingerprint: StoreFingerprint, block_nbytes: int, *,
                 rescan_every_bytes: int | None = None, fsync: bool = False,
                 stale_temp_s: float = STALE_TEMP_S) -> None:  # fmt: skip
        self.capacity_bytes = capacity_bytes
        self.root = fingerprint_dir(directory, fingerprint.hex_id)
        self._digest = fingerprint.digest
        self._nbytes = block_nbytes
        self._fsync = fsync
        self._stale_temp_s = stale_temp_s
        self._rescan_every = rescan_every_bytes or max(capacity_bytes // 8, 1)
        self._since_scan = 0
        self._clock = 0
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self._fail("creating the directory", err)
            return
        self.rescan()

    @property
    def enabled(self) -> bool:
        return bool(self._stats.enabled)

    def _fail(self, what: str, err: OSError) -> None:
        """Count an error and switch the tier off, warning once."""
        with self._lock:
            self._stats.errors += 1
            if not self._stats.enabled:
                return
            self._stats.enabled = 0
            self._index.clear()
            self._stats.blocks = self._stats.bytes_used = 0
        logger.warning("KV store: disk tier %s switched off after an error %s: %s; "
                       "serving on without it", self.root, what, err)  # fmt: skip

    def _stamp(self) -> int:
        """A last-use time, strictly increasing within this process."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    def _set_index(self, index: OrderedDict[bytes, int]) -> None:
        self._index = index
        self._stats.blocks = len(index)
        self._stats.bytes_used = sum(index.values())

    def _pick_victims(self, room: int) -> list[bytes]:
        """Take least recently used blocks out of the index until ``room`` more bytes fit
        (the caller holds the lock and removes their files)."""
        victims = []
        while self._index and self._stats.bytes_used + room > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._stats.blocks -= 1
            self._stats.bytes_used -= size
            self._stats.evictions += 1
            self._stats.bytes_evicted += size
            victims.append(key)
        return victims

    def _remove(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                os.unlink(block_path(self.root, key))
            except FileNotFoundError:
                pass
            except OSError as err:
                self._fail("removing a block file", err)
                return

    def rescan(self) -> None:
        """Rebuild the index from the directory (other processes' files included) and
        evict down to the capacity."""
        try:
            index = scan_directory(self.root, self._stale_temp_s)
        except OSError as err:
            self._fail("scanning the directory", err)
            return
        with self._lock:
            if not self._stats.enabled:
                return
            self._set_index(index)
            self._since_scan = 0
            victims = self._pick_victims(0)
        self._remove(victims)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if not self._stats.enabled:
                return False
            if key in self._index:
                self._stats.hits += 1
                return True
        try:  # written by another process since the last scan?
            size = os.stat(block_path(self.root, key)).st_size
        except OSError:
            size = -1
        with self._lock:
            if size < 0 or not self._stats.enabled:
                self._stats.misses += 1
                return False
            if key not in self._index:
                self._index[key] = size
                self._stats.blocks += 1
                self._stats.bytes_used += size
            self._stats.hits += 1
            return True

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._stats.blocks -= 1
                self._stats.bytes_used -= size

    def discard(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            held = [k for k in keys if k in self._index]
        for key in held:
            self._forget(key)
        self._remove(held)
        return len(held)

    def _skip(self, key: bytes, path: Path, reason: SkipReason) -> None:
        """Count, log and remove a file that cannot be used."""
        self._forget(key)
        with self._lock:
            self._stats.skips[reason.value] += 1
        if reason is SkipReason.MISSING:
            return
        logger.warning("KV store: skipped block file %s (%s); the block is recomputed",
                       path, reason.value)  # fmt: skip
        try:
            os.unlink(path)
        except OSError:
            pass

    def get(self, key: bytes) -> Payload | None:
        with self._lock:
            if not self._stats.enabled or key not in self._index:
                return None
        path = block_path(self.root, key)
        try:
            result = read_block(path, key, self._digest, self._nbytes)
        except OSError as err:
            with self._lock:
                self._stats.errors += 1
            logger.warning("KV store: reading %s failed: %s", path, err)
            self._forget(key)
            return None
        if isinstance(result, SkipReason):
            self._skip(key, path, result)
            return None
        stamp = self._stamp()
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass  # evicted meanwhile: the payload read is whole and verified all the same
        with self._lock:
            self._stats.loads += 1
            self._stats.bytes_read += file_size(key, len(result))
            if key in self._index:
                self._index.move_to_end(key)
        return result

    def put(self, key: bytes, payload: Payload) -> Evicted:
        """Write a block file (on the store's writer thread). The disk is the last tier:
        what it evicts is gone, so it returns no blocks (a block larger than the capacity
        is returned, not written)."""
        size = file_size(key, payload_nbytes(payload))
        with self._lock:
            if not self._stats.enabled:
                return []
            if size > self.capacity_bytes:
                return [(key, payload)]
            held = key in self._index
            if held:
                self._index.move_to_end(key)
            victims = [] if held else self._pick_victims(size)
        stamp = self._stamp()
        path = block_path(self.root, key)
        if held:
            try:
                os.utime(path, ns=(stamp, stamp))
                return []
            except FileNotFoundError:
                self._forget(key)  # removed by another process: write it again
                return self.put(key, payload)
            except OSError as err:
                self._fail("marking a block used", err)
                return []
        self._remove(victims)
        try:
            written = write_block(path, key, self._digest, payload, mtime_ns=stamp,
                                  fsync=self._fsync)  # fmt: skip
        except OSError as err:
            self._fail("writing a block file", err)
            return []
        with self._lock:
            if not self._stats.enabled:
                return []
            self._index[key] = written
            self._stats.blocks += 1
            self._stats.bytes_used += written
            self._stats.writes += 1
            self._stats.bytes_written += written
            self._since_scan += written
            rescan = self._since_scan >= self._rescan_every
        if rescan:
            self.rescan()
        return []

    def stats(self) -> dict[str, int | dict[str, int]]:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        """Nothing to release: the files stay for the next start."""
