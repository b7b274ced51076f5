"""The pool of KV blocks: reference counts, a free queue in eviction order, and the prefix-hash index.

Invariants (checked by `check_integrity`):
- a block is in the free queue iff its reference count is 0;
- a block with a hash is in `_block_by_hash` under that hash, and only there;
- free blocks keep their hash (and their KV) until they are handed out again: that is the prefix cache.

The free queue is least-recently-freed first: `allocate` takes from its head (evicting whatever cached
prefix that block held), `free` appends to its tail. Callers free a request's blocks tail-first, so the
last blocks of a prefix are evicted before its first ones.

The queue starts as every block in id order, and is kept in two parts, so that a pool costs nothing to
make (an ordered dict of a TP change's 16k-block pools was ~2 ms of Python, inside the streams' pause, at
the change's planning and adoption): the blocks never handed out, `[_fresh, num_blocks)` less those `touch`
took out of it (`_skipped`), which are the head, in id order; then `_free`, the blocks freed since, in the
order they were freed.
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
        # The free queue (see the module docstring): the never-used range first, then `_free`, head first.
        self._fresh = 0
        self._skipped: set[int] = set()  # ids >= _fresh that are not free (taken by `touch`)
        self._free: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    # -- queries ------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.num_blocks - self._fresh - len(self._skipped) + len(self._free)

    def is_free(self, block_id: int) -> bool:
        # (A block `touch` took out of the range and that was freed since is in `_free`, and still skipped.)
        return (block_id >= self._fresh and block_id not in self._skipped) or block_id in self._free

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of_block[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """Block id holding the KV of the prefix ending in `block_hash`, or None."""
        return self._block_by_hash.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first)."""
        return [b for b in range(self._fresh, self.num_blocks) if b not in self._skipped] + list(self._free)

    def cached_hashes(self, limit: int) -> list[int]:
        """Up to `limit` cached block hashes, most recently registered/used last."""
        hashes = list(self._block_by_hash)
        return hashes[-limit:] if limit > 0 else []

    # -- mutations ----------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` fresh blocks (ref count 1), evicting cached prefixes; None if not enough."""
        assert num_blocks >= 0, "cannot allocate a negative number of blocks"
        if num_blocks > self.num_free:
            return None
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id = self._pop_head()
            old_hash = self._hash_of_block[block_id]
            if old_hash is not None:
                del self._block_by_hash[old_hash]
                self._hash_of_block[block_id] = None
                self.num_evictions += 1
            self._ref_count[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def _pop_head(self) -> int:
        while self._fresh < self.num_blocks:
            block_id = self._fresh
            self._fresh += 1
            if block_id in self._skipped:
                self._skipped.discard(block_id)
                continue
            return block_id
        block_id, _ = self._free.popitem(last=False)
        return block_id

    def _remove_free(self, block_id: int) -> None:
        """Take a free block out of the queue, wherever it is in it."""
        if block_id >= self._fresh and block_id not in self._skipped:
            self._skipped.add(block_id)
        else:
            del self._free[block_id]

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit); revives free ones."""
        for block_id in block_ids:
            if self._ref_count[block_id] == 0:
                self._remove_free(block_id)
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
            assert (count == 0) == self.is_free(block_id), (
                f"block {block_id}: ref count {count} disagrees with free-queue membership"
            )
            block_hash = self._hash_of_block[block_id]
            if block_hash is not None:
                assert self._block_by_hash.get(block_hash) == block_id, f"block {block_id} hash not indexed"
        for block_hash, block_id in self._block_by_hash.items():
            assert self._hash_of_block[block_id] == block_hash, f"hash index points at wrong block {block_id}"
        assert self.num_free <= self.num_blocks, "free queue larger than the pool"
        assert all(b >= self._fresh for b in self._skipped), "a skipped id below the never-used range"
        assert all(b < self._fresh or b in self._skipped for b in self._free), "a freed block in the never-used range"
