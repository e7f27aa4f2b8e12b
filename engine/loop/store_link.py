"""The engine's KV block store: opened from the configuration, fed between steps.

``--kv-host-gb`` (a host-memory tier) and ``--kv-store-dir`` with ``--kv-store-gb`` (a
disk tier) put :class:`pagedserve.engine.kvstore.KVBlockStore` below the pool: blocks the
pool evicts are saved to it, and a prompt whose prefix misses in the pool but goes on in
the store has those blocks read back instead of computed
(:mod:`pagedserve.engine.core.kv_tier` says how the scheduler waits for them).

The bytes move here, on the engine's thread, at fixed points of a step: the evicted
blocks are copied out of the cache first (a block the step reuses still holds its old
bytes then), the blocks read are copied in next, then the forward pass runs; with
``--kv-store-write-through`` the blocks the step computed in full are copied out after
it. Copying out only queues the bytes: the store's writer thread writes them, so a step
never waits on the disk, and a load is read by the store's reader thread while the step
loop goes on.

What is not stored: blocks of LoRA requests (their chain keys name an adapter by id,
name and path, which may mean other weights after a restart), models with
sliding-window layers (their KV groups; the store is off, with a warning), tensor-parallel
engines (refused by the configuration). The store's fingerprint
(:func:`store_fingerprint`) covers the model's files, the dtypes, the block size, the
tensor-parallel shard, the kernel path, the maximum length (rope scaling may depend on
it) and the payload's layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.engine.kvstore import KVBlockStore, StoreFingerprint, open_store
from pagedserve.engine.worker.kv_blocks import KVBlockCopier

if TYPE_CHECKING:
    from pagedserve.blockmgr.block_pool import BlockPool
    from pagedserve.engine.core.scheduler_output import SchedulerOutput
    from pagedserve.engine.worker.worker import Worker

logger = logging.getLogger("pagedserve.engine.kvstore")

FULL_HASH_BYTES = 2 << 30
"""Model files up to this total are hashed in full; beyond it, each file by its name,
size, modification time and 4 sampled MiB (hashing a large checkpoint in full would cost
seconds to minutes at every start)."""
_SAMPLES = 4
_SAMPLE_BYTES = 1 << 20


def model_files_digest(paths: Sequence[Path]) -> str:
    """A digest of the regular files in ``paths`` (folders: their top-level files)."""
    files = sorted({f for p in paths for f in ((p,) if p.is_file() else p.iterdir())
                    if f.is_file()})  # fmt: skip
    full = sum(f.stat().st_size for f in files) <= FULL_HASH_BYTES
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0".encode())
        with f.open("rb") as fh:
            if full:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
                continue
            h.update(str(st.st_mtime_ns).encode())
            for i in range(_SAMPLES):
                fh.seek(st.st_size * i // _SAMPLES)
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def store_fingerprint(worker: Worker, copier: KVBlockCopier) -> StoreFingerprint:
    """Everything that shapes the bytes of a block of this worker's cache."""
    settings = worker.settings
    paths = [settings.model_path]
    if settings.quantization == "gguf":
        paths.append(worker._gguf_file())
    kernel = worker.attn.name
    if worker.cpu_paths is not None:
        kernel += json.dumps({k: v for k, v in worker.cpu_paths.items()
                              if k not in ("cpu", "features")}, sort_keys=True, default=str)
    return StoreFingerprint.build({
        "model_hash": model_files_digest(paths),
        "dtype": str(settings.dtype), "kv_cache_dtype": str(worker.kv_dtype),
        "block_size": settings.config.block_size, "tp_rank": worker.rank,
        "tp_size": settings.config.tensor_parallel_size, "kernel_path": kernel,
        "layout": copier.layout, "quantization": str(settings.quantization),
        "max_model_len": settings.max_model_len})  # fmt: skip


class EngineKVStore:
    """The store and the copies between it and the worker's cache (see the module)."""

    def __init__(self, store: KVBlockStore, copier: KVBlockCopier, max_queued: int) -> None:
        self.store = store
        self.copier = copier
        self._max_queued = max_queued
        self._close = weakref.finalize(self, store.close)

    @classmethod
    def open(cls, worker: Worker) -> EngineKVStore | None:
        """The store the configuration asks for, or None (none asked for, or a model
        the store does not serve: sliding-window layers)."""
        config = worker.config
        host = int((config.kv_host_gb or 0) * 2**30)
        disk = int((config.kv_store_gb or 0) * 2**30) if config.kv_store_dir else 0
        if not host and not disk:
            return None
        if worker.kv_groups.sliding:
            logger.warning("KV store off: the model has sliding-window layers; the store "
                           "serves models whose layers all attend to the whole context")
            return None
        copier = KVBlockCopier(worker.kv_cache)
        fingerprint = store_fingerprint(worker, copier)
        queued = max(64, min(4096, (64 << 20) // copier.block_nbytes))
        store = open_store(fingerprint, copier.block_nbytes, directory=config.kv_store_dir,
                           disk_bytes=disk, host_bytes=host, max_queued_writes=queued)
        if store is None:
            return None
        logger.info("KV store: %s; blocks of %d bytes, fingerprint %s%s",
                    ", ".join(f"{t.name} {t.capacity_bytes / 2**30:.2f} GiB" for t in store.tiers),
                    copier.block_nbytes, fingerprint.hex_id,
                    ", write-through" if config.kv_store_write_through else "")  # fmt: skip
        return cls(store, copier, queued)

    def before_forward(self, sched: SchedulerOutput) -> None:
        """Copy the evicted blocks out (queued for the writer), then the loaded ones in."""
        if sched.blocks_to_save:
            self.put(sched.blocks_to_save)
        if sched.blocks_to_load:
            ids, payloads = zip(*sched.blocks_to_load, strict=True)
            self.copier.write(ids, payloads)

    def after_forward(self, sched: SchedulerOutput, pool: BlockPool) -> None:
        """Write-through: copy out the blocks the step computed, those still cached under
        their key (a failed request's blocks lost theirs)."""
        keep = [(k, b) for k, b in sched.blocks_to_write if pool.block_hash[b] == k]
        if keep:
            self.put(keep)

    def put(self, blocks: Sequence[tuple[bytes, int]], wait: bool = False) -> None:
        """Queue the blocks' bytes for the store; never blocks unless ``wait`` (reset and
        shutdown), which writes them in batches that fit the queue rather than drop, and
        only the last ones (the most recently used) that the store's tiers can hold.
        Without ``wait``, only the last ones the queue has room for are copied out; the
        rest count as dropped writes."""
        if wait:
            room = sum(t.capacity_bytes for t in self.store.tiers) // self.copier.block_nbytes
            blocks = blocks[max(0, len(blocks) - room):]
        else:  # what the queue would drop is not copied out (blocks come oldest first)
            room = self.store.room()
            if len(blocks) > room:
                self.store.drop(len(blocks) - room)
                blocks = blocks[len(blocks) - room:]
            if not blocks:
                return
        step = self._max_queued if wait else max(1, len(blocks))
        for i in range(0, len(blocks), step):
            batch = blocks[i:i + step]
            for (key, _), payload in zip(batch, self.copier.read([b for _, b in batch]),
                                         strict=True):  # fmt: skip
                self.store.put(key, payload)
            if wait:
                self.store.flush()

    def stats(self) -> dict[str, int]:
        """The store's counters, flat: ``store_*`` and ``<tier>_*`` (skips summed)."""
        out: dict[str, int] = {}
        for part, counters in self.store.stats().items():
            for name, value in counters.items():
                out[f"{part}_{name}"] = sum(value.values()) if isinstance(value, dict) else value
        return out

    def close(self) -> None:
        """Write what is queued, copy the host tier's blocks to the disk tier (if both),
        and stop the store's threads."""
        if self._close.alive and len(self.store.tiers) > 1:
            self.store.write_back()
        self._close()
