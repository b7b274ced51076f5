"""The shape of this worker's KV caches at every TP level: read once at boot, so a TP change reads nothing."""

from __future__ import annotations

from nitsum.engine.params import EngineConfig
from nitsum.engine.runner import num_kv_blocks_for
from nitsum.kv.reshard import KVGeometry
from nitsum.model import loader


class CacheLayout:
    def __init__(self, cfg: EngineConfig, levels) -> None:
        self.model_config = loader.load_config(cfg.model_dir)
        self.block_size = cfg.block_size
        self.dtype = loader.dtype_of(cfg.dtype)
        self.geometry = KVGeometry(self.model_config.num_layers, self.model_config.num_kv_heads, cfg.block_size)
        self.num_blocks_of = {
            tp: num_kv_blocks_for(self.model_config, tp, cfg.block_size, self.dtype, cfg.num_kv_blocks, cfg.kv_cache_mb)
            for tp in levels
        }

    def cache_shape(self, tp: int) -> tuple[int, ...]:
        """[layers, K/V, blocks, block_size, local_kv_heads, head_dim] of a cache at TP=`tp`."""
        cfg = self.model_config
        return (
            cfg.num_layers,
            2,
            self.num_blocks_of[tp],
            self.block_size,
            loader.kv_heads_per_rank(cfg, tp),
            cfg.head_dim,
        )
