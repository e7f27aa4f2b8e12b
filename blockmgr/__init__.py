"""Paging core: KV cache blocks, per-request block tables and the prefix cache.

Pure Python (no torch, no numpy) so the scheduler and its tests run anywhere.
"""

from blockmgr.hashing import BlockHash, hash_block_tokens
from blockmgr.manager import KVCacheManager
from blockmgr.protocol import KVRequest
from blockmgr.stats import KVCacheStats
from blockmgr.util import cdiv

__all__ = ["BlockHash", "KVCacheManager", "KVCacheStats", "KVRequest", "cdiv", "hash_block_tokens"]
