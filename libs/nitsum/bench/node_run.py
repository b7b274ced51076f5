"""Run one worker of a node from argv and a scripted coordinator (tests and `nitsum bench reconfigure`).

    python -m nitsum.bench.node_run --model-dir D --rank R --world-size N --master-port P \
        --script script.json --out out.json [--shm-dir DIR] [--num-kv-blocks 64] [--fail-prepare-epoch E]
        [--kv-path auto|shm|tcp|p2p] [--precopy-chunk-bytes N] [--host-id H] [--fail-kv-connect-epoch E]
        [--fail-kv-chunk-epoch E ...]

The script stands in for the coordinator: {"topology": [[start, tp], ...], "events": [...]}, each event
{"tick": T, "kind": "add" | "prepare" | "commit" | "abort", ...}; "add" names the leader that gets the
request ("leader", "request_id", "prompt", "max_tokens"), "prepare" the new topology ("groups"); a topology
command with "leaders": [ranks] reaches only those leaders (a lost message). A leader
counts its loop iterations as ticks and applies the events of each tick before that tick's step; all
leaders apply a topology command at the same tick, which is the step boundary the protocol needs.
On the shm KV path a leader whose group is pre-copying runs one pre-copy round per tick, before that
tick's step (so the old group decodes while its KV moves); a prepare's ack is recorded when its pre-copy
is done (at the latest at the commit, which finishes what is left).

`--host-id` stands in for NITSUM_HOST_ID (tests split one machine into "hosts": pairs across them move KV
over TCP); `--fail-kv-connect-epoch E` makes this worker's KV receiver drop every connection of epoch E
unanswered (NITSUM_FAULT_KV_CONNECT_EPOCH), and `--fail-kv-chunk-epoch E` (repeatable) makes it refuse every
chunk of epoch E after the hello (a link that breaks during pre-copy or the commit's delta).

Every worker writes --out (JSON): the tokens each leader emitted ([tick, request_id, index, token,
finished, unix time]), every ack, checks made after boot and after each commit (weights are views of the boot store,
checkpoint bytes read, this node's KV segments left in /dev/shm, TCP KV connections and receiver threads
open), the KV bytes moved and planned per path, every migration pair with its path, the IP_TOS of every TCP
KV link, and at exit the engine's KV integrity.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from nitsum.config import WorkerConfig
from nitsum.engine.params import EngineConfig, SamplingParams
from nitsum.model import loader
from nitsum.node.boot import node_weights, node_world
from nitsum.node.precopy import DEFAULT_CHUNK_BYTES
from nitsum.node.runtime import NodeCommand, NodeRuntime
from nitsum.parallel.weights import DEFAULT_SHM_DIR, ResidentWeights, SharedWeightStore
from nitsum.topology import Topology
from nitsum.transfer import shm

IDLE_SLEEP_S = 0.002


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nitsum.bench.node_run")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--min-tp", type=int, default=1)
    parser.add_argument("--max-tp", type=int, default=None)
    parser.add_argument("--shm-dir", default=DEFAULT_SHM_DIR)
    parser.add_argument("--num-kv-blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--script", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-prepare-epoch", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--kv-path", default="auto", choices=("auto", "shm", "tcp", "p2p"))
    parser.add_argument("--precopy-chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--host-id", default="")
    parser.add_argument("--fail-kv-connect-epoch", type=int, default=0)
    parser.add_argument("--fail-kv-chunk-epoch", type=int, action="append", default=[])
    parser.add_argument(
        "--device", default="cpu", help="cpu | cuda (workers beyond the visible GPUs share them, over gloo)"
    )
    parser.add_argument("--decode-attention", default="auto", choices=("auto", "flex", "gather"))
    parser.add_argument(
        "--resident-weights",
        action="store_true",
        help="compute on this device's resident boot copy (what CUDA does) instead of the store's views",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.num_threads)
    script = json.loads(open(args.script).read())
    t_boot = time.perf_counter()
    worker = WorkerConfig(
        device_index=args.rank,
        node_size=args.world_size,
        node_master_addr=args.master_addr,
        node_master_port=args.master_port,
        device=args.device,
        min_tp=args.min_tp,
        max_tp=args.max_tp,
        world_timeout_s=60.0,  # NodeWorld's own default: what this scripted worker has always used
    )
    world = node_world(worker)
    store = SharedWeightStore.open(args.model_dir, "float32", args.shm_dir)
    # The store's views on CPU; on CUDA (or forced here) this device's resident copy of what it may use.
    weights = node_weights(worker, store, args.model_dir, world.device, True if args.resident_weights else None)
    holder = weights if isinstance(weights, ResidentWeights) else store
    cfg = EngineConfig(
        model_dir=args.model_dir,
        device=world.device,
        dtype="float32",  # the store's dtype
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        enable_prefix_caching=True,
        decode_attention=args.decode_attention,
    )

    def failure_hook(phase: str, epoch: int) -> None:
        if phase == "prepare" and epoch == args.fail_prepare_epoch:
            raise RuntimeError("injected failure")

    runtime = NodeRuntime(
        world,
        cfg,
        weights,
        Topology.of(args.world_size, script["topology"]),
        failure_hook,
        kv_path=args.kv_path,
        precopy_chunk_bytes=args.precopy_chunk_bytes,
        host_id=args.host_id,
        master_addr=args.master_addr,
        kv_fault_epoch=args.fail_kv_connect_epoch,
        kv_fault_chunk_epochs=tuple(args.fail_kv_chunk_epoch),
    )
    boot_ms = (time.perf_counter() - t_boot) * 1000.0
    ready_unix = time.time()  # ready to serve (the restart baseline's end): the runners built ahead are not waited for
    report: dict = {
        "rank": args.rank,
        "device": world.device,
        "num_groups": world.num_groups,
        "store_created": store.created,
        "boot_bytes_read": loader.bytes_read,
        "boot_ms": boot_ms,
        "ready_unix": ready_unix,
        "records": [],
        "acks": [],
        "checks": [],
        "kv_path": runtime.kv_path,
        "node_tag": runtime.node_tag,
        "precopy_rounds": [],
        "hosts": [m.host for m in runtime.members],
        "resident_bytes": weights.tensor_bytes if isinstance(weights, ResidentWeights) else None,
    }

    def check(label: str) -> None:
        # A commit leaves the new cache's page reservation running (it is off the pause); its descriptor is
        # closed once that is done, which is what the fd count below checks.
        runtime.reap_reservations(wait=True)
        params = list(runtime.runner.model.parameters())
        report["checks"].append(
            {
                "label": label,
                "epoch": runtime.epoch,
                "group": [runtime.group.start, runtime.group.tp],
                "runner_id": id(runtime.runner),
                "runner_builds": runtime.runner_builds,
                "engines_at_commit": runtime.engines_at_commit,
                "views_of_store": all(holder.contains(p) for p in params),
                "num_params": len(params),
                "bytes_read": loader.bytes_read,
                "kv_segments": shm.leftovers(runtime.node_tag),
                "kv_segment_fds": _segment_fds(),
                "arenas_held": runtime.arenas_held,
                "kv_data_plane": list(runtime.kv_data_plane_open()),
            }
        )

    runtime.wait_built_ahead()  # a script's changes then find every level's runner (deterministic tests)
    check("boot")
    events = sorted(script["events"], key=lambda e: e["tick"])
    last_tick = max((e["tick"] for e in events), default=0)
    tick = 0
    skip_events_at = -1  # a peer promoted by a commit resumes at that tick, its events already applied
    try:
        while True:
            if not runtime.is_leader:
                kind = runtime.follow()
                done = runtime.take_prepare_ack()  # its group's pre-copy completed (a round, or the commit)
                if done is not None:
                    _record_ack(report, -1, done)
                if kind == "control" and not runtime.last_ack.pending:
                    _record_ack(report, -1, runtime.last_ack)
                    _after(report, runtime.last_ack, check, runtime)
                    if runtime.is_leader:  # promoted: step from the tick the commit came at
                        tick = skip_events_at = _tick_of(events, runtime.last_ack)
                if kind == "shutdown":
                    break
                continue
            if tick != skip_events_at:
                for event in (e for e in events if e["tick"] == tick):
                    _apply(runtime, event, report, tick, check)
            if not runtime.is_leader:
                continue  # it became a peer at this tick's commit
            if runtime.precopy_pending:  # one round of this group's pre-copy, then this tick's step
                epoch = runtime.prepared_epoch
                sent = runtime.precopy(wait_build=True)
                report["precopy_rounds"].append([tick, epoch, sent])
                done = runtime.take_prepare_ack()
                if done is not None:
                    _record_ack(report, tick, done)
            # A token's index in its stream, from the engine's own count (moved along with the request).
            emitted = runtime.engine.num_output_tokens()
            outputs = runtime.step()
            now = time.time()
            for out in outputs:
                index = emitted[out.request_id]
                for token in out.new_token_ids:
                    report["records"].append([tick, out.request_id, index, token, out.finished, now])
                    index += 1
            if tick > last_tick and not runtime.has_unfinished():
                runtime.shutdown()
                break
            if not outputs:
                time.sleep(IDLE_SLEEP_S)
            tick += 1
        if runtime.engine is not None:
            runtime.engine.check_integrity()
            stats = runtime.engine.stats()
            report["final"] = {"free": stats.num_kv_blocks_free, "total": stats.num_kv_blocks_total}
        report["final_group"] = [runtime.group.start, runtime.group.tp]
        report["end_bytes_read"] = loader.bytes_read
        report["bytes_by_path"] = dict(runtime.counters.bytes_by_path)
        report["planned_by_path"] = dict(runtime.counters.planned_by_path)
        report["kv_pairs"] = [list(p) for p in runtime.counters.kv_pairs]
        report["kv_tos"] = list(runtime.counters.kv_tos)
        report["epoch"] = runtime.epoch
        world.barrier()
        report["end_kv_segments"] = shm.leftovers(runtime.node_tag)
        report["end_kv_data_plane"] = list(runtime.kv_data_plane_open())
    finally:
        runtime.close()
        with open(args.out, "w") as handle:
            json.dump(report, handle)
        world.destroy()
    return 0


def _apply(runtime: NodeRuntime, event: dict, report: dict, tick: int, check) -> None:
    kind = event["kind"]
    if kind == "add":
        if event["leader"] != runtime.rank:
            return
        params = SamplingParams(max_tokens=event["max_tokens"], ignore_eos=True)
        runtime.add_request(event["request_id"], event["prompt"], params)
        return
    if "leaders" in event and runtime.rank not in event["leaders"]:
        return  # a command that only reaches some leaders (the others' copy was lost)
    cmd = NodeCommand(kind, event["epoch"], tuple(tuple(g) for g in event.get("groups", ())))
    ack = runtime.command(cmd)
    done = runtime.take_prepare_ack()  # a commit finished the pre-copy: that prepare's ack comes first
    if done is not None:
        _record_ack(report, tick, done)
    if ack.pending:  # accepted; the final ack follows when the pre-copy is done
        report.setdefault("prepare_steps", []).append([tick, ack.epoch, ack.duration_ms])
    else:
        _record_ack(report, tick, ack)
    _after(report, ack, check, runtime)


def _after(report: dict, ack, check, runtime: NodeRuntime) -> None:
    """Checks after a commit; after an abort, which of this node's KV segments are still in /dev/shm; after
    an abort or a refused prepare or commit, the TCP KV connections and receiver threads still open."""
    if ack.phase == "commit" and ack.ok:
        # Where this worker's pause went (ms since its commit began, cumulative; see Transition.commit).
        report.setdefault("commit_timings", []).append([ack.epoch, dict(runtime.last_commit_timings_ms)])
        check("commit")
    elif ack.phase == "abort":
        report.setdefault("abort_kv_segments", []).append([ack.epoch, shm.leftovers(report["node_tag"])])
        report.setdefault("abort_kv_segment_fds", []).append([ack.epoch, _segment_fds() - runtime.arenas_held])
    if ack.phase == "abort" or not ack.ok:
        report.setdefault("failed_kv_data_plane", []).append([ack.phase, ack.epoch, list(runtime.kv_data_plane_open())])


def _segment_fds() -> int:
    """File descriptors of this process open on a KV segment (a reservation made or given up closes its own)."""
    count = 0
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += os.path.basename(target).startswith(shm.SEGMENT_PREFIX)
    return count


def _record_ack(report: dict, tick: int, ack) -> None:
    report["acks"].append([tick, ack.phase, ack.epoch, ack.ok, ack.reason, ack.duration_ms, ack.bytes_moved])


def _tick_of(events: list[dict], ack) -> int:
    for e in events:
        if e["kind"] == ack.phase and e["epoch"] == ack.epoch:
            return e["tick"]
    raise AssertionError(f"no scripted event for {ack}")


if __name__ == "__main__":
    raise SystemExit(main())
