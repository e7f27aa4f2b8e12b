"""I/O errors switch the disk tier off with one warning; the store serves on from memory."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from pathlib import Path

import pytest

from pagedserve.engine.kvstore import DiskTier, KVBlockStore, MemoryTier
from tests.helpers.kvstore import FILE_BYTES, NBYTES, fingerprint, key, payload


def _store(tmp_path: Path, memory_blocks: int = 2) -> KVBlockStore:
    return KVBlockStore([MemoryTier(memory_blocks * NBYTES),
                         DiskTier(tmp_path, 100 * FILE_BYTES, fingerprint(), NBYTES)],
                        NBYTES)  # fmt: skip


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pagedserve.engine.kvstore" and r.levelno == logging.WARNING]


def _fill_and_check(store: KVBlockStore, caplog, n: int = 6) -> None:
    """Put ``n`` blocks through a 2-block memory tier into a failing disk: one warning,
    the disk off, the last 2 blocks still served from memory."""
    for i in range(n):
        assert store.put(key(i), payload(key(i)))
        store.flush()
    stats = store.stats()
    assert stats["disk"]["enabled"] == 0 and stats["disk"]["errors"] == 1
    assert stats["disk"]["blocks"] == 0 and stats["disk"]["writes"] == 0
    assert len([w for w in _warnings(caplog) if "switched off" in w]) == 1
    assert store.longest_prefix([key(n - 2), key(n - 1)]) == 2
    assert store.longest_prefix([key(0)]) == 0
    ticket = store.request_load([key(n - 2), key(n - 1)])
    assert ticket.wait(5) and ticket.payloads() == [payload(key(n - 2)), payload(key(n - 1))]
    store.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT])
def test_write_error_switches_the_disk_off_once(tmp_path: Path, monkeypatch, caplog,
                                                 code: int) -> None:  # fmt: skip
    real_open = os.open

    def failing_open(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", failing_open)
    with caplog.at_level(logging.WARNING):
        _fill_and_check(_store(tmp_path), caplog)
    assert list(tmp_path.rglob("*.kvb")) == []


def test_a_directory_that_cannot_be_created(tmp_path: Path, caplog) -> None:
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        disk = DiskTier(tmp_path / "file" / "store", FILE_BYTES, fingerprint(), NBYTES)
        store = KVBlockStore([MemoryTier(2 * NBYTES), disk], NBYTES)
        _fill_and_check(store, caplog)


def test_a_read_only_directory(tmp_path: Path, caplog) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories (the EACCES case is simulated "
                    "in test_write_error_switches_the_disk_off_once)")
    store = _store(tmp_path)
    disk = store.tiers[1]
    disk.root.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING):
            _fill_and_check(store, caplog)
    finally:
        disk.root.chmod(0o755)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 256 KiB tmpfs, where mounting one is allowed (root, outside most containers)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:  # fmt: skip
        pytest.skip("cannot mount a tmpfs here (the disk-full case is simulated instead)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_really_full_disk(tiny_tmpfs: Path, caplog) -> None:
    """The tier's capacity (100 blocks) is more than the file system holds (about 30 of
    these files: two pages each)."""
    with caplog.at_level(logging.WARNING):
        store = _store(tiny_tmpfs)
        for i in range(100):
            store.put(key(i), payload(key(i)))
            store.flush()
    stats = store.stats()
    assert stats["disk"]["enabled"] == 0 and stats["disk"]["errors"] == 1
    assert 0 < stats["disk"]["writes"] < 100
    assert len(list(tiny_tmpfs.rglob("*.kvb"))) == stats["disk"]["writes"]
    assert len([w for w in _warnings(caplog) if "No space left" in w]) == 1
    assert list(tiny_tmpfs.rglob(".tmp-*")) == []
    assert store.longest_prefix([key(98), key(99)]) == 2
    ticket = store.request_load([key(99)])
    assert ticket.wait(5) and ticket.payloads() == [payload(key(99))]
    store.close()
