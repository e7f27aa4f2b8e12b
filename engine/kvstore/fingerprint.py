"""What a stored block's bytes depend on, as one digest.

A block's KV bytes are a function of its tokens (covered by the chained prefix key) and
of everything that shapes the cache: the model's files, the dtypes, the block size, the
tensor-parallel shard, the kernel path where it changes values, the layout of the bytes
in the payload. :class:`StoreFingerprint` hashes those named fields, together with the
store's :data:`FORMAT_VERSION`, into a 16-byte digest. Every block file carries the digest
in its header and lives under a directory named by :attr:`StoreFingerprint.hex_id`, so a
block written under any other configuration is never read back as one of this one's.

The engine must supply every field of :data:`ENGINE_FIELDS`; it may add more (a field it
adds later changes the digest, so older blocks simply stop matching, which is safe).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from hashlib import blake2b

FORMAT_VERSION = 1
"""The on-disk format of block files (their header and directory layout). A change to
either bumps it: files of another version are skipped, never parsed as this one's."""

ENGINE_FIELDS = (
    "model_hash",  # a hash of the model's weight and config files (and the adapter's, if any)
    "dtype",  # the model's compute dtype
    "kv_cache_dtype",  # the cache's element type (fp8 variants store other bytes)
    "block_size",  # tokens per block
    "tp_rank",  # which tensor-parallel shard of the heads the payload holds
    "tp_size",
    "kernel_path",  # the attention/KV-write path, where it changes the values written
    "layout",  # how the worker lays a block's K and V bytes of all layers in the payload
)
"""The fields a fingerprint must name (see :class:`StoreFingerprint`)."""

FieldValue = str | int


def _encode(version: int, fields: tuple[tuple[str, FieldValue], ...]) -> bytes:
    """Unambiguous bytes of the version and the sorted fields: every name and value is
    length-prefixed and every value tagged with its type, so ``1`` and ``"1"`` differ."""
    out = bytearray(b"pagedserve-kvstore\x00")
    out += version.to_bytes(4, "little")
    for name, value in fields:
        raw_name = name.encode()
        tag, raw = (b"i", str(value).encode()) if isinstance(value, int) else (b"s", value.encode())
        out += len(raw_name).to_bytes(4, "little") + raw_name
        out += tag + len(raw).to_bytes(4, "little") + raw
    return bytes(out)


@dataclass(frozen=True)
class StoreFingerprint:
    """The configuration a block's bytes were computed under, as a stable digest.

    Build it with :meth:`build`. ``digest`` (16 bytes) goes into every block file's
    header; ``hex_id`` (its first 16 hex digits) names the block files' directory. Two
    fingerprints are equal exactly when their version and fields are.
    """

    fields: tuple[tuple[str, FieldValue], ...]
    """``(name, value)`` pairs sorted by name."""
    version: int = FORMAT_VERSION
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest",
                           blake2b(_encode(self.version, self.fields), digest_size=16).digest())

    @classmethod
    def build(cls, fields: Mapping[str, FieldValue], *, version: int = FORMAT_VERSION,
              required: tuple[str, ...] = ENGINE_FIELDS) -> StoreFingerprint:
        """The fingerprint of ``fields``. Raises ``ValueError`` when a name of ``required``
        is missing and ``TypeError`` when a value is not a ``str`` or an ``int`` (a
        ``bool`` is refused too: spell flags as strings so their meaning is explicit)."""
        missing = [name for name in required if name not in fields]
        if missing:
            raise ValueError(f"KV store fingerprint lacks fields {missing}")
        for name, value in fields.items():
            if not isinstance(name, str) or isinstance(value, bool) or not isinstance(
                    value, (str, int)):  # fmt: skip
                raise TypeError(f"KV store fingerprint field {name!r}={value!r}: "
                                "names are str, values str or int")
        return cls(tuple(sorted(fields.items())), version)

    @property
    def hex_id(self) -> str:
        """A short id for directory names (the header keeps the full digest)."""
        return self.digest[:8].hex()
