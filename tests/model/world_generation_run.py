"""One worker of tests/model/test_world_generation.py (run as a script): a node world, the loss of a member,
a re-formation that fails (the member is still missing), and one that succeeds among the survivors and a
fresh process, which then merges to TP4. The worker's own pieces do it (services/worker: PeerLossGuard,
StandbyBackend, form_generation), on the engine directly instead of through NATS.

    python world_generation_run.py --model-dir D --rank R --size N --port P --sync DIR --out OUT.json
        --requests JSON [--fresh]

Boot member (no --fresh): joins generation 0, adds its requests, steps BOOT_STEPS times, writes
`ready-<rank>` in DIR and waits for `go` (meanwhile the test SIGKILLs one member); steps ALONE_STEPS more (its
world is broken; at TP=1 nothing notices), tries generation 1 with a short timeout (it fails: the dead member's
replacement is not there yet), writes `failed-<rank>`, steps ALONE_STEPS more on the same backend (serving as
before), waits for `go2` (the test has started the fresh process) and joins generation 2.
Fresh member (--fresh): a standalone TP=1 engine on the node's shared weights (StandbyBackend: what a worker
restarted in standby runs), adds its requests, steps ALONE_STEPS times, joins generation 2.
In generation 2 each NodeRuntime adopts the engine it served with (requests and KV as they are), steps
GEN_STEPS more at TP=1, then every worker runs prepare + commit of 4xTP1 -> TP4 (p2p KV path: the full blocks
move in the prepare step) and the TP4 group runs every request to its end.

--out (JSON): every token emitted ([request id, index, token]), the failed attempt (why, and the backend's state
after it), the acks, the generation and rendezvous port of the new world, whether the TP4 runner's parameters
are views of the shared store, KV integrity at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nitsum.engine import Engine, EngineConfig, SamplingParams
from nitsum.engine.runner import ModelRunner
from nitsum.model import loader
from nitsum.node.runtime import NodeCommand, NodeRuntime
from nitsum.parallel.group import TPGroup
from nitsum.parallel.weights import SharedWeightStore, boot_weights
from nitsum.parallel.world import NodeWorld
from nitsum.topology import Topology
from nitsum_services.worker.backend import StandbyBackend
from nitsum_services.worker.peer_loss import PeerLossGuard, form_generation

BOOT_STEPS = 4
ALONE_STEPS = 2
GEN_STEPS = 2
WAIT_S = 120.0
FAILING_TIMEOUT_S = 3.0  # the failed attempt's rendezvous: nobody hosts it
WORLD_TIMEOUT_S = 30.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--sync", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--shm-dir", required=True)
    p.add_argument("--requests", required=True, help="JSON [[request id, prompt, max tokens], ...] added here")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--fresh", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    sync = Path(args.sync)
    cfg = EngineConfig(model_dir=args.model_dir, num_kv_blocks=64, block_size=args.block_size)
    config = loader.load_config(args.model_dir)
    store = SharedWeightStore.open(args.model_dir, "float32", args.shm_dir)
    weights = boot_weights(store, "cpu", args.rank, 1, args.size, config=config, node_size=args.size)
    report: dict = {"rank": args.rank, "fresh": args.fresh, "records": [], "acks": []}

    def step(engine) -> None:
        emitted = engine.num_output_tokens()
        for out in engine.step():
            for i, token in enumerate(out.new_token_ids):
                report["records"].append([out.request_id, emitted[out.request_id] + i, token])

    if args.fresh:
        runner = ModelRunner(
            args.model_dir,
            TPGroup.single("cpu"),
            block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks,
            weights=weights,
            config=config,
        )
        backend = StandbyBackend(Engine(cfg, runner=runner), args.rank, weights, cfg)
    else:
        world0 = NodeWorld(args.rank, args.size, "127.0.0.1", args.port, timeout_s=WORLD_TIMEOUT_S)
        runtime0 = NodeRuntime(world0, cfg, weights, Topology.uniform(args.size, 1), kv_path="p2p")
        backend = PeerLossGuard(runtime0, runtime0.engine.model_name, runtime0.engine.max_model_len)
    engine = backend.engine
    for rid, prompt, max_tokens in json.loads(args.requests):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not (sync / name).exists():
            assert time.monotonic() < deadline, f"no {name} from the test"
            time.sleep(0.01)

    def attempt(generation: int, timeout_s: float) -> NodeRuntime:
        def make_world():
            return NodeWorld(args.rank, args.size, "127.0.0.1", args.port, timeout_s=timeout_s, generation=generation)

        def make_runtime(world, cfg, weights, engine, epoch):
            return NodeRuntime(
                world, cfg, weights, Topology.uniform(args.size, 1), kv_path="p2p", engine=engine, epoch=epoch
            )

        return form_generation(backend, make_world, make_runtime)

    if not args.fresh:
        for _ in range(BOOT_STEPS):
            step(engine)
        (sync / f"ready-{args.rank}").write_text("")
        wait_for("go")
        for _ in range(ALONE_STEPS):
            step(engine)
        try:
            attempt(1, FAILING_TIMEOUT_S)
            report["failed_attempt"] = None
        except Exception as exc:  # expected: device 0 is not back, nobody hosts generation 1's rendezvous
            report["failed_attempt"] = {
                "error": f"{type(exc).__name__}: {exc}"[:300],
                "in_world": backend.in_world,
                "same_engine": backend.engine is engine,
                "group": list(backend.group),
                "world_lost": backend.runtime.world_lost[:300],
            }
        (sync / f"failed-{args.rank}").write_text("")
        for _ in range(ALONE_STEPS):
            step(backend.engine)  # serving on as before
        wait_for("go2")
    else:
        for _ in range(ALONE_STEPS):
            step(engine)
    runtime = attempt(2, WORLD_TIMEOUT_S)
    world = runtime.world
    if isinstance(backend, PeerLossGuard):
        backend.runtime.close()
    report["generation"], report["rendezvous_port"] = world.generation, world.master_port
    report["adopted"] = runtime.engine is engine
    for _ in range(GEN_STEPS):
        step(runtime.engine)
    for kind in ("prepare", "commit"):
        ack = runtime.command(NodeCommand(kind, runtime.epoch + 1, ((0, args.size),) if kind == "prepare" else ()))
        report["acks"].append([ack.phase, ack.epoch, ack.ok, ack.reason])
        assert ack.ok, ack
    report["group"] = [runtime.group.start, runtime.group.tp]
    report["views_of_store"] = all(store.contains(t) for t in runtime.runner.model.parameters())
    if runtime.is_leader:
        while runtime.has_unfinished():
            step(runtime.engine)
        runtime.engine.check_integrity()
        stats = runtime.engine.stats()
        report["final"] = {"free": stats.num_kv_blocks_free, "total": stats.num_kv_blocks_total}
        runtime.shutdown()
    else:
        while runtime.follow() != "shutdown":
            pass
    runtime.close()
    world.destroy()
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
