"""A node worker's world and boot weights, from its `WorkerConfig`: the worker service's boot
(`nitsum_services.worker.boot`) and the scripted worker of `nitsum.bench.node_run` start one alike."""

from __future__ import annotations

from nitsum.config import WorkerConfig
from nitsum.model import loader
from nitsum.parallel.weights import SharedWeightStore, boot_weights
from nitsum.parallel.world import NodeWorld, allowed_levels


def node_world(config: WorkerConfig, generation: int = 0) -> NodeWorld:
    """This worker's node world (generation `generation`: 0 at boot, more after a re-formation)."""
    return NodeWorld(
        config.device_index,
        config.node_size,
        config.node_master_addr,
        config.node_master_port,
        device=config.device,
        min_tp=config.min_tp,
        max_tp=config.max_tp,
        timeout_s=config.world_timeout_s,
        generation=generation,
    )


def node_weights(config: WorkerConfig, store: SharedWeightStore, model_dir: str, device: str, resident=None):
    """CPU: the host-wide store's views. CUDA: this device's resident copy of the slices it uses at every
    allowed level, made once here (ALGORITHMS.md §1.1); every later TP change cuts views of it. `resident`:
    see `boot_weights`."""
    levels = allowed_levels(config.min_tp, config.max_tp or config.node_size)
    return boot_weights(
        store,
        device,
        config.device_index,
        levels[0],
        levels[-1],
        config=loader.load_config(model_dir),
        node_size=config.node_size,
        resident=resident,
    )
