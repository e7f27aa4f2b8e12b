"""Paging core: KV cache blocks, per-request block tables and the prefix cache.

Pure Python (no torch, no numpy) so the scheduler and its tests run anywhere.
"""

from pagedserve.blockmgr.hashing import BlockHash, hash_block_tokens
from pagedserve.blockmgr.manager import KVCacheManager
from pagedserve.blockmgr.protocol import KVRequest
from pagedserve.blockmgr.stats import KVCacheStats
from pagedserve.blockmgr.util import cdiv

__all__ = ["BlockHash", "KVCacheManager", "KVCacheStats", "KVRequest", "cdiv", "hash_block_tokens"]
