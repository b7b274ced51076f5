"""Pure paged-KV bookkeeping (standard library only; no torch).

The engine owns the KV tensors; this package only decides which block ids hold which tokens:
`BlockPool` (reference counts, free queue in eviction order, hash -> block index), `KVCacheManager`
(per-request block tables, prefix reuse) and the chained block hashes in `prefix`.
"""

from nitsum.kv.block_pool import BlockPool
from nitsum.kv.block_table import KVCacheManager
from nitsum.kv.prefix import NONE_HASH, block_hashes, hash_block

__all__ = ["BlockPool", "KVCacheManager", "NONE_HASH", "block_hashes", "hash_block"]
