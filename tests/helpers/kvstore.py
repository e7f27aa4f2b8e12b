"""Keys, payloads and fingerprints for the KV store tests, and the child processes that
write into a store directory (run as a script: ``python kvstore.py MODE ARGS``).

A payload is derived from its key, so any payload read back can be checked against the
key it was asked for.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from hashlib import blake2b
from pathlib import Path

from pagedserve.engine.kvstore import ENGINE_FIELDS, DiskTier, KVBlockStore, StoreFingerprint

NBYTES = 4096
"""Payload bytes of a test block."""
FILE_BYTES = 46 + 16 + NBYTES
"""Bytes of its file (header, 16-byte key, payload)."""


def key(i: int) -> bytes:
    """The ``i``-th test key (16 bytes, like a chained prefix key)."""
    return blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(k: bytes, nbytes: int = NBYTES) -> bytes:
    """The payload stored under key ``k``."""
    unit = blake2b(k, digest_size=64).digest()
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


def fingerprint(**changes: str | int) -> StoreFingerprint:
    """A complete fingerprint; ``changes`` override or add fields."""
    fields: dict[str, str | int] = {name: f"{name}-value" for name in ENGINE_FIELDS}
    fields.update(block_size=16, tp_rank=0, tp_size=1)
    fields.update(changes)
    return StoreFingerprint.build(fields)


def dir_bytes(root: Path) -> int:
    """Bytes of the block files under ``root`` (temporary files included)."""
    total = 0
    for path in root.rglob("*.kvb"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _stall(directory: str, stall_at: int, nbytes: int) -> None:
    """Write blocks 0.. and hang half-way through the payload of block ``stall_at``."""
    tier = DiskTier(directory, 1 << 30, fingerprint(), nbytes)
    real_write = os.write

    def write(fd: int, data) -> int:
        if len(data) == nbytes and stalling:
            real_write(fd, data[: nbytes // 2])
            print("MID", flush=True)
            time.sleep(3600)
        return real_write(fd, data)

    os.write = write
    for i in range(stall_at + 1):
        stalling = i == stall_at
        tier.put(key(i), payload(key(i), nbytes))


def _loop(directory: str, nbytes: int) -> None:
    """Write blocks in a loop until killed."""
    tier = DiskTier(directory, 64 * (nbytes + 100), fingerprint(), nbytes)
    i = 0
    while True:
        tier.put(key(i % 200), payload(key(i % 200), nbytes))
        i += 1
        if i == 5:
            print("READY", flush=True)


def _share(directory: str, capacity: int, seed: int, rounds: int) -> None:
    """Put and load random blocks of a shared key space; report what loads returned."""
    store = KVBlockStore([DiskTier(directory, capacity, fingerprint(), NBYTES)], NBYTES,
                         max_queued_writes=8)  # fmt: skip
    rng = random.Random(seed)
    loaded = bad = 0
    for _ in range(rounds):
        keys = [key(rng.randrange(120)) for _ in range(3)]
        for k in keys:
            store.put(k, payload(k))
        store.flush()
        ticket = store.request_load(keys)
        ticket.wait(10)
        for k, p in zip(keys, ticket.payloads(), strict=False):
            loaded += 1
            bad += p != payload(k)
    store.close()
    print(json.dumps({"loaded": loaded, "bad": bad, "stats": store.stats()}), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "stall":
        _stall(args[0], int(args[1]), int(args[2]))
    elif mode == "loop":
        _loop(args[0], int(args[1]))
    elif mode == "share":
        _share(args[0], int(args[1]), int(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")


def engine_prompts() -> list[list[int]]:
    """The engine tests' prompts: three sharing 40 tokens (two full blocks of 16) with
    tails of their own, and one of its own."""
    shared = [(i * 37) % 4000 + 5 for i in range(40)]
    return [shared + [900 + i, 901, 902 + i] for i in range(3)] + \
        [[(i * 11) % 3000 + 7 for i in range(53)]]  # fmt: skip


def settled(llm) -> None:
    """An idle engine with a store: the paging core's invariants hold, no block is in
    use and no request waits for a load."""
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.stats().num_used_blocks == 0
    assert not llm.engine.scheduler.waiting_for_kv_load
