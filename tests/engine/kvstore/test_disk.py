"""The disk tier: the byte bound, LRU across restarts, damaged and vanished files,
dead writers' temporary files (a real SIGKILL included)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

from pagedserve.engine.kvstore import DiskTier
from pagedserve.engine.kvstore.files import block_path, fingerprint_dir, write_block
from tests.helpers.kvstore import FILE_BYTES, NBYTES, fingerprint, key, payload
from tests.helpers.subprocess import run_as_script

HELPER = Path(__file__).resolve().parents[2] / "helpers" / "kvstore.py"


def _tier(tmp_path: Path, blocks: int, **kw) -> DiskTier:
    return DiskTier(tmp_path, blocks * FILE_BYTES, fingerprint(), NBYTES, **kw)


def _files(tier: DiskTier) -> set[bytes]:
    return {bytes.fromhex(p.stem) for p in tier.root.rglob("*.kvb")}


def test_roundtrip_and_counters(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 4)
    assert tier.put(key(0), payload(key(0))) == []
    assert tier.contains(key(0)) and not tier.contains(key(1))
    assert tier.get(key(0)) == payload(key(0))
    assert tier.get(key(1)) is None
    s = tier.stats()
    assert (s["hits"], s["misses"], s["loads"], s["bytes_read"]) == (1, 1, 1, FILE_BYTES)
    assert (s["writes"], s["bytes_written"], s["blocks"], s["bytes_used"]) == (
        1, FILE_BYTES, 1, FILE_BYTES)
    assert s["evictions"] == s["errors"] == 0 and s["enabled"] == 1
    assert set(s["skips"].values()) == {0}


def test_never_above_capacity_after_any_put(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 3)
    for i in range(10):
        tier.put(key(i), payload(key(i)))
        assert tier.stats()["bytes_used"] <= 3 * FILE_BYTES
        assert sum(p.stat().st_size for p in tier.root.rglob("*.kvb")) <= 3 * FILE_BYTES
    assert _files(tier) == {key(7), key(8), key(9)}
    s = tier.stats()
    assert (s["evictions"], s["bytes_evicted"], s["writes"]) == (7, 7 * FILE_BYTES, 10)
    assert tier.put(key(99), payload(key(99), 4 * FILE_BYTES)) != []  # larger than it all


def test_lru_across_a_restart(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 3)
    for i in range(3):
        tier.put(key(i), payload(key(i)))
    assert tier.get(key(0)) == payload(key(0))  # 1 is now the least recently used
    tier = _tier(tmp_path, 3)
    assert tier.stats()["blocks"] == 3
    tier.put(key(3), payload(key(3)))
    assert _files(tier) == {key(0), key(2), key(3)}
    tier = _tier(tmp_path, 3)
    assert tier.get(key(2)) == payload(key(2))
    tier.put(key(4), payload(key(4)))
    assert _files(tier) == {key(2), key(3), key(4)}
    tier = _tier(tmp_path, 1)  # a smaller capacity evicts at start, oldest first
    assert _files(tier) == {key(4)} and tier.stats()["evictions"] == 2


def test_damaged_files_are_counted_skips_and_removed(tmp_path: Path, caplog) -> None:
    tier = _tier(tmp_path, 10)
    for i in range(6):
        tier.put(key(i), payload(key(i)))
    paths = [block_path(tier.root, key(i)) for i in range(6)]
    os.truncate(paths[0], FILE_BYTES - 10)
    data = bytearray(paths[1].read_bytes())
    data[-1] ^= 0xFF
    paths[1].write_bytes(data)
    data = bytearray(paths[2].read_bytes())
    data[20] ^= 0x10
    paths[2].write_bytes(data)
    other = fingerprint(dtype="float32")
    write_block(paths[3], key(3), other.digest, payload(key(3)))
    write_block(paths[4], key(4), fingerprint().digest, payload(key(4)), version=7)
    os.unlink(paths[5])
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.kvstore"):
        for i in range(6):
            assert tier.contains(key(i))
            assert tier.get(key(i)) is None
            assert not tier.contains(key(i))
    logged = [r.getMessage() for r in caplog.records if "skipped block file" in r.getMessage()]
    assert [m.rsplit("(", 1)[1] for m in logged] == [
        "truncated); the block is recomputed", "corrupt); the block is recomputed",
        "corrupt); the block is recomputed", "foreign); the block is recomputed",
        "version); the block is recomputed"]  # a vanished file is a plain miss
    s = tier.stats()
    assert s["skips"] == {"missing": 1, "truncated": 1, "corrupt": 2, "foreign": 1,
                          "version": 1}  # fmt: skip
    assert s["loads"] == 0 and s["bytes_read"] == 0 and s["blocks"] == 0 and s["errors"] == 0
    assert _files(tier) == set()


def test_a_copied_in_file_of_another_fingerprint_is_foreign(tmp_path: Path) -> None:
    other = DiskTier(tmp_path, 10 * FILE_BYTES, fingerprint(kernel_path="triton"), NBYTES)
    other.put(key(1), payload(key(1)))
    tier = _tier(tmp_path, 10)
    assert other.root != tier.root and tier.stats()["blocks"] == 0
    dest = block_path(tier.root, key(1))
    dest.parent.mkdir(parents=True)
    shutil.copy(block_path(other.root, key(1)), dest)
    tier = _tier(tmp_path, 10)
    assert tier.stats()["blocks"] == 1 and tier.get(key(1)) is None
    assert tier.stats()["skips"]["foreign"] == 1 and not dest.exists()
    assert other.get(key(1)) == payload(key(1))


def test_stale_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 10)
    tier.put(key(1), payload(key(1)))
    sub = block_path(tier.root, key(1)).parent
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = sub / f".tmp-{gone.pid}-aa.kvb"
    dead.write_bytes(b"partial")
    alive = sub / f".tmp-{os.getpid()}-bb.kvb"
    alive.write_bytes(b"partial")
    old = sub / f".tmp-{os.getpid()}-cc.kvb"
    old.write_bytes(b"partial")
    os.utime(old, (1, 1))
    junk = sub / ".tmp-junk"
    junk.write_bytes(b"?")
    tier = _tier(tmp_path, 10)
    assert sorted(p.name for p in sub.iterdir()) == sorted([alive.name, f"{key(1).hex()}.kvb"])
    assert tier.stats()["blocks"] == 1 and tier.stats()["bytes_used"] == FILE_BYTES


def _kill_and_check(tmp_path: Path, proc: subprocess.Popen, expect_temp: bool) -> int:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    root = fingerprint_dir(tmp_path, fingerprint().hex_id)
    temps = list(root.rglob(".tmp-*"))
    assert bool(temps) or not expect_temp
    tier = DiskTier(tmp_path, 1 << 30, fingerprint(), NBYTES)
    assert list(root.rglob(".tmp-*")) == []
    keys = [bytes.fromhex(p.stem) for p in root.rglob("*.kvb")]
    assert keys and len(keys) == tier.stats()["blocks"]
    for k in keys:
        assert tier.get(k) == payload(k)
    assert set(tier.stats()["skips"].values()) == {0}
    return len(keys)


def test_sigkill_mid_write_leaves_nothing_trusted(tmp_path: Path) -> None:
    proc = subprocess.Popen([*run_as_script(HELPER, "stall", str(tmp_path), "3", str(NBYTES))],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "MID"
    assert _kill_and_check(tmp_path, proc, expect_temp=True) == 3


def test_sigkill_of_a_writing_loop(tmp_path: Path) -> None:
    big = 1 << 20
    proc = subprocess.Popen([*run_as_script(HELPER, "loop", str(tmp_path), str(big))],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tier = DiskTier(tmp_path, 1 << 30, fingerprint(), big)
    keys = [bytes.fromhex(p.stem) for p in tier.root.rglob("*.kvb")]
    assert len(keys) >= 5 and list(tier.root.rglob(".tmp-*")) == []
    for k in keys:
        assert tier.get(k) == payload(k, big)
    assert set(tier.stats()["skips"].values()) == {0}
