"""Stage-1 KV reuse in the engine: cached prefix blocks exported by one engine and imported by another
give the same tokens while the importer computes only the rest of the prompt."""

from __future__ import annotations

import torch

from nitsum.engine import Engine, EngineConfig, SamplingParams
from nitsum.kv import KVCacheManager, block_hashes

BLOCK_SIZE = 16


def test_reserve_import_skips_cached_hashes_and_leaves_blocks_cached_but_free():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.reserve_import([11, 12]) == [(0, 0), (1, 1)]
    kv.finish_import([0, 1])
    assert kv.pool.num_free == 4 and kv.cached_prefix([11, 12, 13]) == [0, 1]
    # 11 is cached: only 13 gets a block (the head of the free queue: block 2)
    assert kv.reserve_import([11, 13]) == [(1, 2)]
    kv.finish_import([2])
    assert kv.cached_prefix([11, 13]) == [0, 2] and kv.cached_prefix([12]) == [1]
    kv.check_integrity()


def test_imported_prefix_blocks_give_identical_tokens_with_fewer_prefill_tokens(tiny_model_dir):
    torch.set_num_threads(1)
    cfg = dict(model_dir=str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=32)
    prompt = [3 + (j * 17) % 250 for j in range(50)]  # 3 full blocks + 2 tokens
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    source = Engine(EngineConfig(**cfg))
    expected = source.generate([prompt], params)[0]

    hashes = block_hashes(prompt, BLOCK_SIZE)
    assert len(hashes) == 3
    found, kv = source.export_cached_blocks(hashes)
    assert found == hashes and tuple(kv.shape[:3]) == (4, 2, 3)

    target = Engine(EngineConfig(**cfg))
    assert target.import_cached_blocks(found, kv) == 3
    assert target.import_cached_blocks(found, kv) == 0  # already cached: nothing written twice
    assert target.generate([prompt], params)[0] == expected
    stats = target.stats()
    assert stats.num_cached_prompt_tokens == 48
    assert source.stats().num_prefill_tokens_computed == len(prompt)
    assert stats.num_prefill_tokens_computed == len(prompt) - 48
    target.check_integrity()


def test_export_stops_at_the_first_hash_not_cached(tiny_model_dir):
    cfg = dict(model_dir=str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=32)
    engine = Engine(EngineConfig(**cfg))
    prompt = list(range(3, 40))
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    hashes = block_hashes(prompt, BLOCK_SIZE)
    found, kv = engine.export_cached_blocks([hashes[0], 12345, hashes[1]])
    assert found == [hashes[0]] and kv.shape[2] == 1
