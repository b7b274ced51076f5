"""Exact-id tests of the paged-KV bookkeeping (pure stdlib)."""

import pytest

from nitsum.kv import BlockPool, KVCacheManager, block_hashes, hash_block
from nitsum.kv.prefix import NONE_HASH


def test_allocate_takes_free_queue_head_in_order():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.free_block_ids() == [3]
    assert pool.allocate(2) is None  # no room is a value, nothing changes
    assert pool.free_block_ids() == [3]
    pool.check_integrity()


def test_free_appends_in_given_order_and_reuses_lru_first():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    pool.free([3])
    assert pool.free_block_ids() == [2, 0, 3]
    assert pool.allocate(2) == [2, 0]
    pool.check_integrity()


def test_ref_counts_shared_block_freed_only_when_last_reference_drops():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache(b, 111)
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.free_block_ids() == [1]
    pool.free([b])
    assert pool.free_block_ids() == [1, 0]
    with pytest.raises(AssertionError):
        pool.free([b])


def test_cached_free_block_is_revived_by_touch_and_evicted_by_allocate():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, 7) and pool.cache(b, 8)
    pool.free([b, a])
    assert pool.lookup(7) == a and pool.lookup(8) == b
    pool.touch([a])  # prefix hit on a free block
    assert pool.free_block_ids() == [b] and pool.ref_count(a) == 1
    assert pool.allocate(1) == [b]  # evicts hash 8
    assert pool.lookup(8) is None and pool.lookup(7) == a
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, 5) is True
    assert pool.cache(b, 5) is False
    assert pool.lookup(5) == a and pool.block_hash(b) is None


def test_chained_hashes_depend_on_whole_prefix():
    toks = list(range(10))
    h = block_hashes(toks, 4)
    assert len(h) == 2  # the partial third block has none
    assert h[0] == hash_block(NONE_HASH, [0, 1, 2, 3])
    assert h[1] == hash_block(h[0], [4, 5, 6, 7])
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != h[1]
    assert hash_block(NONE_HASH, [0, 1, 2, 3]) == hash_block(NONE_HASH, (0, 1, 2, 3))
    assert 0 <= h[1] < 2**63


def test_manager_prefix_reuse_exact_ids():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert kv.find_prefix(prompt) == []
    assert kv.allocate("a", 10) == [0, 1, 2]
    kv.commit("a", prompt, 10)
    assert kv.free("a") is True
    # Freed tail first: the free queue holds the fresh blocks, then 2, 1, 0.
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    # Same first 8 tokens -> both full blocks hit; at least one token is always left to compute.
    assert kv.find_prefix(prompt[:8] + [99]) == [0, 1]
    assert kv.find_prefix(prompt[:8]) == [0]
    hit = kv.find_prefix(prompt[:8] + [99])
    assert kv.allocate("b", 9, hit) == [3]
    assert kv.block_table("b") == [0, 1, 3]
    kv.check_integrity()
    kv.free("b")
    kv.check_integrity()
    assert kv.pool.num_free == 8


def test_manager_no_room_leaves_state_unchanged():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate("a", 8) == [0, 1]
    assert kv.allocate("b", 8) is None
    assert not kv.has("b")
    assert kv.allocate("a", 9) == [2]
    assert kv.allocate("a", 13) is None
    assert kv.block_table("a") == [0, 1, 2]
    kv.check_integrity()


def test_manager_revived_prefix_blocks_count_against_free_room():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.allocate("a", 4)
    kv.commit("a", [1, 2, 3, 4], 4)
    kv.free("a")
    hit = kv.find_prefix([1, 2, 3, 4, 5])
    assert hit == [0, 1]
    # Needs one more block beyond the two hits; both hits are free blocks, so there is no room.
    assert kv.can_allocate("b", 5, hit) is False
    assert kv.allocate("b", 5, hit) is None
    assert kv.allocate("b", 4, hit) == []
    kv.check_integrity()


def test_prefix_caching_disabled_finds_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    kv.allocate("a", 4)
    kv.commit("a", [1, 2, 3, 4], 4)
    kv.free("a")
    assert kv.find_prefix([1, 2, 3, 4, 5]) == []


def test_kv_package_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, nitsum.kv; assert 'torch' not in sys.modules, 'nitsum.kv imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_quick_table_check_finds_what_the_full_one_finds_in_the_held_blocks():
    """`check_tables` (a TP change's freshly adopted engine) looks only at the blocks the tables hold."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 10) == [0, 1, 2]
    assert kv.allocate("b", 4) == [3]
    kv.check_tables()
    kv.check_integrity()
    kv.pool._ref_count[1] = 2  # a table that does not hold block 1 twice
    with pytest.raises(AssertionError, match="block 1"):
        kv.check_tables()
    with pytest.raises(AssertionError):
        kv.check_integrity()
    kv.pool._ref_count[1] = 1
    kv.pool._remove_free(5)  # a block nobody holds that is not free either (lost)
    with pytest.raises(AssertionError, match="free blocks"):
        kv.check_tables()
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_a_pool_behaves_as_one_ordered_free_queue_whatever_the_sequence():
    """The pool keeps its free queue in two parts (the never-used range, then freed blocks); checked against a
    plain ordered queue of every block under random allocate / free / touch / cache sequences."""
    import random
    from collections import OrderedDict

    for seed in range(40):
        rng = random.Random(seed)
        n = rng.randint(1, 24)
        pool = BlockPool(n)
        queue = OrderedDict((i, None) for i in range(n))  # the reference: every free block, head first
        refs = [0] * n
        for _ in range(200):
            op = rng.random()
            if op < 0.35:
                k = rng.randint(0, 4)
                got = pool.allocate(k)
                if k > len(queue):
                    assert got is None
                    continue
                want = [queue.popitem(last=False)[0] for _ in range(k)]
                assert got == want
                for b in want:
                    refs[b] = 1
            elif op < 0.65:
                held = [b for b in range(n) if refs[b] > 0]
                if held:
                    b = rng.choice(held)
                    pool.free([b])
                    refs[b] -= 1
                    if refs[b] == 0:
                        queue[b] = None
            elif op < 0.85:
                b = rng.randrange(n)  # a prefix hit: on a held block, or one still free (anywhere in the queue)
                pool.touch([b])
                if refs[b] == 0:
                    del queue[b]
                refs[b] += 1
            else:
                held = [b for b in range(n) if refs[b] > 0 and pool.block_hash(b) is None]
                if held:
                    b = rng.choice(held)
                    pool.cache(b, 1000 * seed + b)
            assert pool.free_block_ids() == list(queue)
            assert pool.num_free == len(queue)
            assert all(pool.is_free(b) == (b in queue) for b in range(n))
            assert [pool.ref_count(b) for b in range(n)] == refs
            pool.check_integrity()
