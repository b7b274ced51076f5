"""Per-request block tables over a `BlockPool`, with automatic prefix reuse.

Protocol (the scheduler drives it; nothing here touches KV bytes):
1. `find_prefix(token_ids)` -> block ids whose KV already holds a prefix of the request (never all of
   it: at least one token is always computed, because sampling needs its logits).
2. `allocate(request_id, num_tokens, prefix_block_ids)` makes the table cover `num_tokens` tokens;
   None ("no room now") leaves everything unchanged, so the caller may preempt and retry.
3. `commit(request_id, token_ids, num_computed_tokens)` after a forward: newly full blocks get their
   chained hash and become reusable by later requests.
4. `free(request_id)` drops the table; its hashed blocks stay cached until evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nitsum.kv.block_pool import BlockPool
from nitsum.kv.prefix import NONE_HASH, hash_block


@dataclass
class _Table:
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the leading full blocks whose KV is computed (len <= len(block_ids)).
    hashes: list[int] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert block_size > 0, "block_size must be positive"
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, _Table] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id].block_ids

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached block ids covering the longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        block_ids: list[int] = []
        parent = NONE_HASH
        for index in range(max_blocks):
            start = index * self.block_size
            parent = hash_block(parent, token_ids[start : start + self.block_size])
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def can_allocate(self, request_id: str, num_tokens: int, prefix_block_ids: Sequence[int] = ()) -> bool:
        table = self._tables.get(request_id)
        have = len(table.block_ids) if table else 0
        need_new = max(0, self.blocks_for(num_tokens) - have - len(prefix_block_ids))
        # A prefix hit on a free block removes it from the free queue, so it cannot also be handed out.
        revived = sum(1 for b in prefix_block_ids if self.pool.ref_count(b) == 0)
        return need_new <= self.pool.num_free - revived

    def allocate(self, request_id: str, num_tokens: int, prefix_block_ids: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` tokens; returns the new block ids or None."""
        table = self._tables.get(request_id)
        assert not (prefix_block_ids and table and table.block_ids), (
            f"prefix blocks can only seed an empty table (request {request_id})"
        )
        if not self.can_allocate(request_id, num_tokens, prefix_block_ids):
            return None
        if table is None:
            table = self._tables[request_id] = _Table()
        if prefix_block_ids:
            self.pool.touch(prefix_block_ids)
            table.block_ids.extend(prefix_block_ids)
            for block_id in prefix_block_ids:
                block_hash = self.pool.block_hash(block_id)
                assert block_hash is not None, f"prefix block {block_id} has no hash"
                table.hashes.append(block_hash)
        need_new = max(0, self.blocks_for(num_tokens) - len(table.block_ids))
        new_ids = self.pool.allocate(need_new)
        assert new_ids is not None, "can_allocate said yes"
        table.block_ids.extend(new_ids)
        return new_ids

    def adopt(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Take a table whose KV was written from elsewhere (a TP change or P/D import moved it here).

        Blocks repeated across adopted tables are shared (reference counted). The blocks get their
        prefix hashes at the next `commit`.
        """
        assert request_id not in self._tables, f"request {request_id} already holds blocks"
        self.pool.touch(block_ids)
        self._tables[request_id] = _Table(block_ids=list(block_ids))

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Hash and cache every block that became full now that `num_computed_tokens` are computed."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(table.block_ids))
        for index in range(len(table.hashes), num_full):
            start = index * self.block_size
            parent = table.hashes[-1] if table.hashes else NONE_HASH
            block_hash = hash_block(parent, token_ids[start : start + self.block_size])
            table.hashes.append(block_hash)
            self.pool.cache(table.block_ids[index], block_hash)

    def cached_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest leading run of `block_hashes` cached here (a stage-1 fetch's source)."""
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def reserve_import(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """Stage-1 import, step 1: (position in `block_hashes`, block id) for every hash not cached here yet,
        each in a fresh block registered under its hash and held (ref 1) so nothing evicts it while the
        caller writes its KV. Stops early when the pool has no free block left. Then `finish_import`."""
        reserved: list[tuple[int, int]] = []
        if not self.enable_prefix_caching:
            return reserved
        for position, block_hash in enumerate(block_hashes):
            if self.pool.lookup(block_hash) is not None:
                continue
            new_ids = self.pool.allocate(1)
            if new_ids is None:
                break
            self.pool.cache(new_ids[0], block_hash)
            reserved.append((position, new_ids[0]))
        return reserved

    def finish_import(self, block_ids: Sequence[int]) -> None:
        """Stage-1 import, step 2: the KV is written; the blocks become free but cached (a prefix hit revives them)."""
        self.pool.free(reversed(list(block_ids)))

    def free(self, request_id: str) -> bool:
        """Release a request's blocks (tail first, so its prefix head is evicted last)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return False
        self.pool.free(reversed(table.block_ids))
        return True

    def check_tables(self) -> None:
        """The cheap half of `check_integrity`, in the blocks the tables hold (not the whole pool): each held
        block's reference count is the number of tables that hold it, none is in the free queue, and every other
        block is (a freshly adopted engine: its pool was built right before, so it has nothing else to check)."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            for block_id in table.block_ids:
                held[block_id] = held.get(block_id, 0) + 1
        for block_id, count in held.items():
            assert self.pool.ref_count(block_id) == count, (
                f"block {block_id}: ref count {self.pool.ref_count(block_id)} but {count} tables hold it"
            )
        assert self.pool.num_free == self.pool.num_blocks - len(held), (
            f"{self.pool.num_free} free blocks, expected {self.pool.num_blocks} - {len(held)} held"
        )

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        expected = [0] * self.pool.num_blocks
        for request_id, table in self._tables.items():
            assert len(table.hashes) <= len(table.block_ids), f"{request_id}: more hashes than blocks"
            for block_id in table.block_ids:
                expected[block_id] += 1
        for block_id, count in enumerate(expected):
            assert self.pool.ref_count(block_id) == count, (
                f"block {block_id}: ref count {self.pool.ref_count(block_id)} but {count} tables hold it"
            )
