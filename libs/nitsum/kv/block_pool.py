"""The pool of KV blocks: reference counts, a free queue in eviction order, and the prefix-hash index.

Invariants (checked by `check_integrity`):
- a block is in the free queue iff its reference count is 0;
- a block with a hash is in `_block_by_hash` under that hash, and only there;
- free blocks keep their hash (and their KV) until they are handed out again: that is the prefix cache.

The free queue is least-recently-freed first: `allocate` takes from its head (evicting whatever cached
prefix that block held), `free` appends to its tail. Callers free a request's blocks tail-first, so the
last blocks of a prefix are evicted before its first ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self._ref_count = [0] * num_blocks
        self._hash_of_block: list[int | None] = [None] * num_blocks
        self._block_by_hash: dict[int, int] = {}
        # Ordered set of free block ids; head = next to hand out (evict).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_evictions = 0

    # -- queries ------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of_block[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """Block id holding the KV of the prefix ending in `block_hash`, or None."""
        return self._block_by_hash.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first)."""
        return list(self._free)

    def cached_hashes(self, limit: int) -> list[int]:
        """Up to `limit` cached block hashes, most recently registered/used last."""
        hashes = list(self._block_by_hash)
        return hashes[-limit:] if limit > 0 else []

    # -- mutations ----------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` fresh blocks (ref count 1), evicting cached prefixes; None if not enough."""
        assert num_blocks >= 0, "cannot allocate a negative number of blocks"
        if num_blocks > len(self._free):
            return None
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            old_hash = self._hash_of_block[block_id]
            if old_hash is not None:
                del self._block_by_hash[old_hash]
                self._hash_of_block[block_id] = None
                self.num_evictions += 1
            self._ref_count[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit); revives free ones."""
        for block_id in block_ids:
            if self._ref_count[block_id] == 0:
                del self._free[block_id]
            self._ref_count[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id; blocks reaching 0 join the tail of the free queue, in this order."""
        for block_id in block_ids:
            assert self._ref_count[block_id] > 0, f"block {block_id} freed more often than taken"
            self._ref_count[block_id] -= 1
            if self._ref_count[block_id] == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: int) -> bool:
        """Register a full, computed block under its hash. False if another block already holds it."""
        assert self._ref_count[block_id] > 0, f"block {block_id} must be in use to be cached"
        current = self._hash_of_block[block_id]
        if current is not None:
            assert current == block_hash, f"block {block_id} already cached under another hash"
            return True
        if block_hash in self._block_by_hash:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (the KV bytes stay until overwritten)."""
        self._block_by_hash.clear()
        self._hash_of_block = [None] * self.num_blocks

    def check_integrity(self) -> None:
        for block_id in range(self.num_blocks):
            count = self._ref_count[block_id]
            assert count >= 0, f"block {block_id} has a negative reference count"
            assert (count == 0) == (block_id in self._free), (
                f"block {block_id}: ref count {count} disagrees with free-queue membership"
            )
            block_hash = self._hash_of_block[block_id]
            if block_hash is not None:
                assert self._block_by_hash.get(block_hash) == block_id, f"block {block_id} hash not indexed"
        for block_hash, block_id in self._block_by_hash.items():
            assert self._hash_of_block[block_id] == block_hash, f"hash index points at wrong block {block_id}"
        assert len(self._free) <= self.num_blocks, "free queue larger than the pool"
