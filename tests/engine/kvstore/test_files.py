"""Block files: a roundtrip, and every kind of damage is a skip reason, never a payload."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pagedserve.engine.kvstore import SkipReason
from pagedserve.engine.kvstore.files import (
    HEADER_FIXED,
    block_path,
    fingerprint_dir,
    key_of,
    read_block,
    temp_owner,
    write_block,
)
from tests.helpers.kvstore import FILE_BYTES, NBYTES, fingerprint, key, payload

FP = fingerprint().digest


def _write(tmp_path: Path, k: bytes, digest: bytes = FP, version: int | None = None) -> Path:
    path = block_path(fingerprint_dir(tmp_path, fingerprint().hex_id), k)
    extra = {} if version is None else {"version": version}
    assert write_block(path, k, digest, payload(k), **extra) == FILE_BYTES
    return path


def test_roundtrip_layout_and_no_temp_left(tmp_path: Path) -> None:
    k = key(1)
    path = _write(tmp_path, k)
    hex_id = fingerprint().hex_id
    assert path == tmp_path / "v1" / hex_id / k.hex()[:2] / f"{k.hex()}.kvb"
    assert os.listdir(path.parent) == [path.name]
    assert path.stat().st_size == FILE_BYTES
    assert read_block(path, k, FP, NBYTES) == payload(k)
    assert key_of(path.name) == k


def test_memoryview_payload_of_another_shape(tmp_path: Path) -> None:
    k = key(2)
    path = block_path(tmp_path, k)
    view = memoryview(payload(k)).cast("I", (NBYTES // 16, 4))
    assert write_block(path, k, FP, view) == FILE_BYTES
    assert read_block(path, k, FP, NBYTES) == payload(k)


def test_truncated_files(tmp_path: Path) -> None:
    k = key(3)
    path = _write(tmp_path, k)
    for size in (FILE_BYTES - 1, HEADER_FIXED + 16, HEADER_FIXED + 3, 20, 5, 0):
        os.truncate(path, size)
        assert read_block(path, k, FP, NBYTES) is SkipReason.TRUNCATED, size


def test_a_longer_file_is_corrupt(tmp_path: Path) -> None:
    k = key(3)
    path = _write(tmp_path, k)
    with open(path, "ab") as f:
        f.write(b"x")
    assert read_block(path, k, FP, NBYTES) is SkipReason.CORRUPT


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset", [HEADER_FIXED + 16, FILE_BYTES // 2, FILE_BYTES - 1])
def test_flipped_payload_byte_is_corrupt(tmp_path: Path, offset: int) -> None:
    k = key(4)
    path = _write(tmp_path, k)
    _flip(path, offset)
    assert read_block(path, k, FP, NBYTES) is SkipReason.CORRUPT


def test_every_flipped_header_byte_is_skipped(tmp_path: Path) -> None:
    k = key(5)
    path = _write(tmp_path, k)
    good = path.read_bytes()
    for offset in range(HEADER_FIXED + 16):
        path.write_bytes(good)
        _flip(path, offset)
        expect = SkipReason.VERSION if 8 <= offset < 12 else SkipReason.CORRUPT
        assert read_block(path, k, FP, NBYTES) is expect, offset


def test_foreign_version_missing_and_misnamed(tmp_path: Path) -> None:
    k = key(6)
    other = fingerprint(model_hash="another model").digest
    path = _write(tmp_path, k, digest=other)
    assert read_block(path, k, FP, NBYTES) is SkipReason.FOREIGN
    assert read_block(path, k, other, NBYTES) == payload(k)
    assert read_block(path, k, other, NBYTES - 1) is SkipReason.FOREIGN
    path = _write(tmp_path, k, version=2)
    assert read_block(path, k, FP, NBYTES) is SkipReason.VERSION
    os.unlink(path)
    assert read_block(path, k, FP, NBYTES) is SkipReason.MISSING
    shutil.copy(_write(tmp_path, key(7)), path)  # block 7's file under block 6's name
    assert read_block(path, k, FP, NBYTES) is SkipReason.CORRUPT


def test_names() -> None:
    assert temp_owner(".tmp-123-abcd.kvb") == 123
    assert temp_owner(".tmp-x-abcd.kvb") is None and temp_owner("ab.kvb") is None
    assert key_of(".tmp-1-ab.kvb") is None and key_of("zz.kvb") is None
    assert key_of("ab.txt") is None and key_of(".kvb") is None and key_of("abcd.kvb") == b"\xab\xcd"


def test_a_failed_write_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    k = key(8)
    path = block_path(tmp_path, k)

    def full(fd: int, data) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError):
        write_block(path, k, FP, payload(k))
    assert os.listdir(path.parent) == []
