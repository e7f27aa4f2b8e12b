"""One block on disk: a self-checking file, written atomically.

Layout of a store directory (``DIR`` is ``--kv-store-dir``)::

    DIR/v<FORMAT_VERSION>/<fingerprint hex id>/<first 2 hex of key>/<key hex>.kvb

A block file is a header and the payload. All integers little-endian:

======  =====  ==============================================================
offset  bytes  field
======  =====  ==============================================================
0       8      magic ``b"PSKVBLK\\0"``
8       4      format version (these 12 bytes keep their meaning in every version)
12      4      crc32 of the header from offset 16 to its end (key included)
16      16     fingerprint digest (:class:`~.fingerprint.StoreFingerprint`)
32      8      payload length in bytes
40      4      crc32 of the payload
44      2      key length ``k`` (1 to :data:`MAX_KEY_BYTES`)
46      k      the block key (the prefix chain key of the block)
46 + k  n      the payload
======  =====  ==============================================================

Guarantees. :func:`write_block` writes into a temporary file of the same directory (named
``.tmp-<pid>-<random>.kvb``: the scanner ignores names starting with ``.``) and renames it
over the final name with ``os.replace``, which is atomic: a reader sees a whole old file,
a whole new one or none, and a writer killed at any point leaves at most a temporary file
(removed by the next scan once its writer is gone). :func:`read_block` trusts nothing: the
magic, version, header checksum, fingerprint, key, lengths and payload checksum are all
verified, and any mismatch is a :class:`SkipReason`, never a payload. crc32 catches every
burst error up to 32 bits and any torn or truncated file; it is not meant to stop a
deliberate forger (the directory's owner is trusted).
"""

from __future__ import annotations

import enum
import os
import secrets
import struct
import zlib
from pathlib import Path

from pagedserve.engine.kvstore.fingerprint import FORMAT_VERSION

MAGIC = b"PSKVBLK\x00"
SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"
MAX_KEY_BYTES = 64

_PREFIX = struct.Struct("<8sI")
_HEAD = struct.Struct("<8sII16sQIH")
HEADER_FIXED = _HEAD.size
"""Bytes of the header before the key (46)."""
_CHECKED_FROM = 16
"""The header checksum covers the header from this offset to its end."""

Payload = bytes | bytearray | memoryview
"""A block's bytes: ``block_nbytes`` of them, opaque to the store."""


def payload_nbytes(payload: Payload) -> int:
    """The bytes in ``payload`` (``len`` of a memoryview counts items of its first axis)."""
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


class SkipReason(str, enum.Enum):
    """Why a block file was not used (the block is then recomputed)."""

    MISSING = "missing"
    """No file (never written, or evicted, possibly by another process)."""
    TRUNCATED = "truncated"
    """Shorter than its header says."""
    CORRUPT = "corrupt"
    """A checksum, the magic, the key or the length does not match."""
    FOREIGN = "foreign"
    """Written under another fingerprint (another model, dtype, shard, ...)."""
    VERSION = "version"
    """Written by another format version."""


def fingerprint_dir(root: str | os.PathLike[str], fingerprint_hex: str,
                    version: int = FORMAT_VERSION) -> Path:  # fmt: skip
    """The directory holding one fingerprint's blocks under store root ``root``."""
    return Path(root) / f"v{version}" / fingerprint_hex


def block_path(directory: Path, key: bytes) -> Path:
    """Where the block keyed ``key`` lives in a fingerprint directory."""
    name = key.hex()
    return directory / name[:2] / f"{name}{SUFFIX}"


def key_of(name: str) -> bytes | None:
    """The key a block file's name spells, or None for any other name (temporary files,
    strays)."""
    if name.startswith(".") or not name.endswith(SUFFIX):
        return None
    try:
        key = bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None
    return key if 0 < len(key) <= MAX_KEY_BYTES else None


def temp_owner(name: str) -> int | None:
    """The pid that wrote temporary file ``name``, or None if ``name`` is not one."""
    if not name.startswith(TEMP_PREFIX):
        return None
    pid = name[len(TEMP_PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def file_size(key: bytes, nbytes: int) -> int:
    """Bytes on disk of a block file with a ``nbytes`` payload."""
    return HEADER_FIXED + len(key) + nbytes


def encode_header(key: bytes, fingerprint: bytes, payload: memoryview,
                  version: int = FORMAT_VERSION) -> bytes:  # fmt: skip
    """The header of a block file for ``payload`` (see the module's table)."""
    if not 0 < len(key) <= MAX_KEY_BYTES or len(fingerprint) != 16:
        raise ValueError(f"block key of {len(key)} bytes or fingerprint of "
                         f"{len(fingerprint)} bytes")
    head = bytearray(_HEAD.pack(MAGIC, version, 0, fingerprint, payload.nbytes,
                                zlib.crc32(payload), len(key)) + key)  # fmt: skip
    struct.pack_into("<I", head, 12, zlib.crc32(memoryview(head)[_CHECKED_FROM:]))
    return bytes(head)


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data):]


def write_block(path: Path, key: bytes, fingerprint: bytes, payload: Payload, *,
                mtime_ns: int | None = None, fsync: bool = False,
                version: int = FORMAT_VERSION) -> int:  # fmt: skip
    """Write a block file atomically (temporary file, then ``os.replace``); returns the
    bytes written. ``mtime_ns`` stamps the file's last-use time before it appears.
    ``fsync`` also makes it survive a power loss (a process kill needs no fsync: the
    checksums catch what a crash of the machine could leave). Raises ``OSError`` (the
    temporary file is removed first)."""
    data = memoryview(payload).cast("B")
    header = encode_header(key, fingerprint, data, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}{SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, memoryview(header))
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(header) + data.nbytes


def _read_exact(f, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = f.readinto(view[got:])
        if not r:
            return None
        got += r
    return buf


def _check_header(head: bytes, key: bytes, fingerprint: bytes,
                  nbytes: int) -> SkipReason | None:  # fmt: skip
    """The fixed header's verdict, the key checked separately (see :func:`read_block`)."""
    magic, version, crc, fp, plen, _pcrc, klen = _HEAD.unpack_from(head)
    if magic != MAGIC:
        return SkipReason.CORRUPT
    if version != FORMAT_VERSION:
        return SkipReason.VERSION
    if klen != len(key):
        return SkipReason.CORRUPT
    if zlib.crc32(memoryview(head)[_CHECKED_FROM:]) != crc:
        return SkipReason.CORRUPT
    if head[HEADER_FIXED:] != key:
        return SkipReason.CORRUPT
    if fp != fingerprint or plen != nbytes:
        return SkipReason.FOREIGN
    return None


def read_block(path: Path, key: bytes, fingerprint: bytes,
               nbytes: int) -> bytearray | SkipReason:  # fmt: skip
    """The verified ``nbytes`` payload of the block file at ``path``, or why it cannot be
    used. Raises ``OSError`` only for errors other than a missing file."""
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        return SkipReason.MISSING
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < _PREFIX.size:
            return SkipReason.TRUNCATED
        head = _read_exact(f, min(size, HEADER_FIXED + len(key)))
        if head is None:
            return SkipReason.TRUNCATED
        magic, version = _PREFIX.unpack_from(head)
        if magic != MAGIC:
            return SkipReason.CORRUPT
        if version != FORMAT_VERSION:
            return SkipReason.VERSION
        if len(head) < HEADER_FIXED + len(key):
            return SkipReason.TRUNCATED
        reason = _check_header(bytes(head), key, fingerprint, nbytes)
        if reason is not None:
            return reason
        if size != len(head) + nbytes:
            return SkipReason.TRUNCATED if size < len(head) + nbytes else SkipReason.CORRUPT
        payload = _read_exact(f, nbytes)
    if payload is None:
        return SkipReason.TRUNCATED
    if zlib.crc32(payload) != _HEAD.unpack_from(head)[5]:
        return SkipReason.CORRUPT
    return payload
