"""A real `NodeRuntime` on a node of one worker (its own gloo world, in a child process): the command rules
every epoch follows (stale, not prepared, nothing to abort, an older prepare ended by a later abort), the
pieces it is composed of, and that it serves the tiny model's tokens -- exactly those of a plain Engine."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from nitsum.natsserver import free_port

pytestmark = pytest.mark.timeout(180)

PROMPT = [5, 17, 42, 8, 99, 3]


def _worker(model_dir: str, port: int, shm_dir: str, out) -> None:
    import torch

    from nitsum.engine import Engine, EngineConfig, SamplingParams
    from nitsum.model import loader
    from nitsum.node.messages import NodeCommand
    from nitsum.node.runtime import NodeRuntime
    from nitsum.parallel.weights import SharedWeightStore, boot_weights
    from nitsum.parallel.world import NodeWorld
    from nitsum.topology import Topology

    torch.set_num_threads(1)
    res: dict = {}
    world = NodeWorld(0, 1, "127.0.0.1", port, timeout_s=30)
    store = SharedWeightStore.open(model_dir, "float32", shm_dir)
    weights = boot_weights(store, "cpu", 0, 1, 1, config=loader.load_config(model_dir), node_size=1)
    cfg = EngineConfig(model_dir=model_dir, num_kv_blocks=64, block_size=16)
    one = Topology.uniform(1, 1)
    runtime = NodeRuntime(world, cfg, weights, one, kv_path="tcp")
    try:
        res["leader"], res["group"] = runtime.is_leader, (runtime.group.start, runtime.group.tp)
        res["kv_path"], res["local"] = runtime.kv_path, runtime.kv_path_of(0, 0)
        res["open"] = runtime.kv_data_plane_open()
        res["commit_unprepared"] = runtime.command(NodeCommand("commit", 1)).reason
        res["abort_nothing"] = runtime.command(NodeCommand("abort", 1)).reason
        prepare = runtime.command(NodeCommand("prepare", 2, ((0, 1),)))
        res["prepare"] = (prepare.ok, prepare.reason, runtime.in_transition, runtime.prepared_epoch)
        res["pending"] = runtime.precopy_pending
        res["other_commit"] = runtime.command(NodeCommand("commit", 1)).reason  # not the prepared epoch
        later_abort = runtime.command(NodeCommand("abort", 3))  # ends the older prepare (its abort was lost)
        res["later_abort"] = (later_abort.ok, runtime.in_transition)
        runtime.command(NodeCommand("prepare", 4, ((0, 1),)))
        commit = runtime.command(NodeCommand("commit", 4))
        res["commit"] = (commit.ok, runtime.epoch, runtime.in_transition, runtime.last_ack == commit)
        res["stale_prepare"] = runtime.command(NodeCommand("prepare", 4, ((0, 1),))).reason
        res["stale_commit"] = runtime.command(NodeCommand("commit", 3)).reason
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        runtime.add_request("r", PROMPT, greedy)
        tokens = []
        while runtime.has_unfinished():
            tokens += [t for o in runtime.step() for t in o.new_token_ids]
        res["tokens"] = tokens
        res["plain"] = Engine(cfg).generate([PROMPT], greedy)[0]
        res["builds"] = runtime.runner_builds
        # A role-only change: the role rides in the committed topology, the leader's id in `leaders`; the engine
        # follows the role, and the runner and engine stay (no KV moves).
        runner, engine = runtime.runner, runtime.engine
        runtime.command(NodeCommand("prepare", 5, ((0, 1),), roles=("decode",), leaders=("w0",)))
        res["role_prepared"] = (runtime.role, runtime.engine.role)
        runtime.command(NodeCommand("commit", 5))
        res["role_committed"] = (runtime.role, runtime.engine.role, runtime.leaders, str(runtime.topology))
        res["role_kept"] = (runtime.runner is runner, runtime.engine is engine, runtime.runner_builds)
    finally:
        runtime.close()
        world.destroy()
    out.put(res)


def test_one_worker_node_follows_the_epoch_rules_and_serves_the_plain_engines_tokens(tiny_model_dir, tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(str(tiny_model_dir), free_port(), str(tmp_path), out))
    proc.start()
    res = out.get(timeout=150)
    proc.join(30)
    assert proc.exitcode == 0
    assert res["leader"] is True and res["group"] == (0, 1)
    assert res["kv_path"] == "tcp" and res["local"] == "local" and res["open"] == (0, 0)
    assert res["commit_unprepared"] == "epoch 1 was not prepared"
    assert res["abort_nothing"] == "nothing prepared"
    # A prepare to the same topology touches no worker: accepted at once, held until its commit or abort.
    assert res["prepare"] == (True, "not affected", True, 2) and res["pending"] is False
    assert res["other_commit"] == "epoch 1 was not prepared"
    assert res["later_abort"] == (True, False)
    assert res["commit"] == (True, 4, False, True)
    assert res["stale_prepare"] == "stale epoch 4 (committed 4)"
    assert res["stale_commit"] == "stale epoch 3 (committed 4)"
    assert res["tokens"] == res["plain"] and len(res["tokens"]) == 8
    assert res["builds"] == 1  # one level: only the runner in use was ever built
    assert res["role_prepared"] == ("hybrid", "hybrid")  # a prepare changes no role
    assert res["role_committed"] == ("decode", "decode", {(0, 1): "w0"}, "[0 TP1 decode]")
    assert res["role_kept"] == (True, True, 1)
