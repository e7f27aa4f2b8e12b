"""Chained block hashes for the prefix cache.

The key of block ``i`` of a request is::

    blake2b(digest_size=16)(parent_key || int64 token ids of block i || extra keys)

where ``parent_key`` is the key of block ``i - 1`` (or :data:`ROOT_HASH`, 16 zero bytes,
for the first block), the token ids are packed as native-endian signed 64-bit integers
(the bytes of ``array('q', tokens)``, produced by a precompiled ``struct.Struct``, which is
about twice as fast as building an array from a list), and each extra key is appended as an 8-byte length followed by its UTF-8 bytes.
Because every key covers its parent's key, equal keys mean equal whole prefixes, not
just equal blocks. The digest is 128 bits, so an accidental collision is not a practical
concern (about 2**64 distinct blocks before a collision becomes likely).

Extra keys are a tuple so more kinds can join later (multimodal hashes). Today they are
the request's ``cache_salt`` and its LoRA adapter's key, which go into the FIRST block's
key so requests with different salts or adapters never share any block. The adapter
enters as two keys (a marker, then its key) so no salt alone can produce its keys.

Cost: one C-level pass over the block's tokens (packing) and one blake2b call per full
block; no per-token Python work.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from hashlib import blake2b

BlockHash = bytes
"""A 16-byte chained block key."""

ExtraKeys = tuple[str, ...]

ROOT_HASH: BlockHash = bytes(16)
"""Parent key of a request's first block."""

NO_EXTRA_KEYS: ExtraKeys = ()

_packers: dict[int, Callable[..., bytes]] = {}


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as native-endian int64 bytes (same bytes as ``array('q', token_ids)``)."""
    n = len(token_ids)
    pack = _packers.get(n)
    if pack is None:
        pack = _packers[n] = struct.Struct(f"={n}q").pack
    return pack(*token_ids)


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys = NO_EXTRA_KEYS
) -> BlockHash:
    """Return the chained key of one full block."""
    h = blake2b(parent, digest_size=16)
    h.update(pack_token_ids(token_ids))
    for key in extra_keys:
        raw = key.encode()
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.digest()


LORA_MARKER = "\x00lora"


def block_extra_keys(cache_salt: str | None, block_index: int,
                     lora_key: str | None = None) -> ExtraKeys:  # fmt: skip
    """Extra keys of block ``block_index`` of a request: the salt and the adapter, on the
    first block only."""
    if block_index != 0:
        return NO_EXTRA_KEYS
    salt = NO_EXTRA_KEYS if cache_salt is None else (cache_salt,)
    return salt if lora_key is None else (*salt, LORA_MARKER, lora_key)


def group_key(key: BlockHash, group: int) -> BlockHash:
    """The pool key of a block of KV group ``group`` holding the tokens keyed ``key``:
    groups hold the same tokens in different blocks, so each caches them apart (group 0
    under the key itself, a later one under the key and its number)."""
    return key if group == 0 else key + bytes((group,))


def split_group_key(pool_key: BlockHash) -> tuple[BlockHash, int]:
    """``(key, group)`` of a pool key made by :func:`group_key`."""
    return (pool_key, 0) if len(pool_key) == 16 else (pool_key[:16], pool_key[16])
