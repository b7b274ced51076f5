"""How a worker's backend is built: a standalone engine, its share of the node world at boot, a standby
engine on the node's shared weights (a restarted node worker, NITSUM_NODE_STANDBY), or its share of a
re-formed world (`join_generation`, run in a background thread by the worker shell)."""

from __future__ import annotations

import logging
import os
import signal

import torch

from nitsum.config import ConfigError, WorkerConfig, parse_die_at
from nitsum.modelpath import resolve_model_dir
from nitsum_services.worker.backend import PlainBackend, StandbyBackend
from nitsum_services.worker.peer_loss import PeerLossGuard, form_generation

log = logging.getLogger("nitsum.worker")


def _engine_config(config: WorkerConfig, role: str):
    from nitsum.engine import EngineConfig

    model_dir = resolve_model_dir(config.model)
    return EngineConfig(
        model_dir=str(model_dir),
        # Workers of one node beyond the GPUs visible share them (tests on one GPU; their TP groups use gloo).
        device=config.device
        if config.device == "cpu"
        else f"cuda:{config.device_index % max(1, torch.cuda.device_count())}",
        dtype=config.dtype,
        block_size=config.block_size,
        kv_cache_mb=config.kv_cache_mb,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        role=role,
        decode_attention=config.decode_attention,
    )


def build_engine(config: WorkerConfig, role: str):
    from nitsum.engine import Engine

    torch.set_num_threads(config.torch_threads)
    engine = Engine(_engine_config(config, role))
    log.info(
        "engine on %s: %s, decode attention %s", engine.runner.device, engine.cfg.dtype, engine.runner.decode_attention
    )
    if engine.runner.flex is not None:
        warm_flex(engine)
    return engine


def warm_flex(engine) -> None:
    """Compile the flex decode attention before serving (batch 1, 2, then the dynamic-shape recompile at 3), so
    that no request's second token waits tens of seconds for it (longer than NITSUM_STREAM_TIMEOUT_S)."""
    import time

    from nitsum.engine import SamplingParams

    t0 = time.perf_counter()
    for n in (1, 2, 3):
        engine.generate([[1, 2 + i] for i in range(n)], SamplingParams(max_tokens=2, ignore_eos=True))
    log.info("flex decode attention compiled in %.1f s", time.perf_counter() - t0)


def build_backend(config: WorkerConfig, role: str):
    """A standalone engine, this worker's share of the node world (boot store + pre-built groups), or, in
    standby (NITSUM_NODE_STANDBY), a standalone engine over the node's boot weights that a re-formed world
    adopts later."""
    torch.set_num_threads(config.torch_threads)
    if config.node_size <= 1:
        return PlainBackend(build_engine(config, role), config.device_index)
    from nitsum.topology import Topology

    if config.min_tp != 1:
        # Node workers boot as one TP=1 group each (and a re-formed world adopts TP=1 engines).
        raise ConfigError(
            f"NITSUM_MIN_TP={config.min_tp}: a node world's workers boot at TP=1, so it needs "
            "NITSUM_MIN_TP=1 (larger groups come from merges)"
        )
    cfg = _engine_config(config, role)
    if config.node_standby:
        return build_standby(config, cfg)
    from nitsum.node.boot import node_world

    world = node_world(config)
    weights = node_weights(config, cfg, world.device)
    runtime = node_runtime(config, world, cfg, weights, Topology.uniform(config.node_size, 1))
    engine = runtime.engine
    return PeerLossGuard(runtime, engine.model_name, engine.max_model_len)


def node_weights(config: WorkerConfig, cfg, device: str):
    """The node's boot weights (`nitsum.node.boot.node_weights`) over the host-wide store."""
    from nitsum.node import boot
    from nitsum.parallel.weights import SharedWeightStore

    return boot.node_weights(config, SharedWeightStore.open(cfg.model_dir, cfg.dtype), cfg.model_dir, device)


def node_runtime(config: WorkerConfig, world, cfg, weights, topology, engine=None, epoch: int = 0):
    from nitsum.node.runtime import NodeRuntime

    def failure_hook(phase: str, epoch: int) -> None:
        if phase == "prepare" and epoch == config.fault_prepare_epoch:
            raise RuntimeError(f"injected failure (NITSUM_FAULT_PREPARE_EPOCH={epoch})")
        die_if_told(config, phase, epoch)

    return NodeRuntime(
        world,
        cfg,
        weights,
        topology,
        failure_hook,
        kv_path=config.kv_path,
        host_id=config.host_id,
        kv_advertise_addr=config.kv_advertise_addr,
        master_addr=config.node_master_addr,
        kv_fault_epoch=config.fault_kv_connect_epoch,
        engine=engine,
        epoch=epoch,
        shm_collectives=config.tp_shm_collectives,
    )


def build_standby(config: WorkerConfig, cfg) -> StandbyBackend:
    """A restarted node worker: TP=1 on the node's boot weights, outside any world until a re-formation."""
    from nitsum.engine import Engine
    from nitsum.engine.runner import ModelRunner
    from nitsum.model import loader
    from nitsum.parallel.group import TPGroup

    if not 0 <= config.device_index < config.node_size:
        raise ValueError(f"NITSUM_DEVICE_INDEX={config.device_index} is outside the node's {config.node_size} devices")
    weights = node_weights(config, cfg, cfg.device)
    runner = ModelRunner(
        cfg.model_dir,
        TPGroup.single(cfg.device),
        device=cfg.device,
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        num_kv_blocks=cfg.num_kv_blocks,
        kv_cache_mb=cfg.kv_cache_mb,
        weights=weights,
        config=loader.load_config(cfg.model_dir),
        decode_attention=cfg.decode_attention,
    )
    log.info("standby: serving standalone at TP=1 until the coordinator re-forms node %s", config.node_id)
    return StandbyBackend(Engine(cfg, runner=runner), config.device_index, weights, cfg)


def join_generation(config: WorkerConfig, backend, generation: int):
    """Background thread: build world `generation` of this worker's node and a NodeRuntime over it that
    adopts the backend's TP=1 engine (peer_loss.form_generation). Returns the new PeerLossGuard."""
    from nitsum.node.boot import node_world
    from nitsum.topology import Topology

    def make_world():
        return node_world(config, generation)

    def make_runtime(world, cfg, weights, engine, epoch):
        return node_runtime(config, world, cfg, weights, Topology.uniform(config.node_size, 1), engine, epoch)

    runtime = form_generation(backend, make_world, make_runtime)
    return PeerLossGuard(runtime, backend.model_name, backend.max_model_len)


def die_if_told(config: WorkerConfig, phase: str, epoch: int) -> None:
    """NITSUM_FAULT_DIE_AT: a worker that dies mid-transition, as a crash would (no goodbye, no drain)."""
    target = parse_die_at(config.fault_die_at)
    if target == (phase, epoch, config.device_index):
        log.error("NITSUM_FAULT_DIE_AT=%s: killing this worker now", config.fault_die_at)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
