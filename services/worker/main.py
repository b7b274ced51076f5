"""`nitsum serve prefill-worker|decode-worker`: one engine per device, driven over NATS.

Subscriptions: `worker.<id>.run` (RunRequest → RunAck), `worker.<id>.control` (topology Prepare / Commit /
Abort, NodeReform, RoleChange → TopologyAck; StreamOffset, no reply), the abort broadcast, `coordinator_up` (answer with fresh stats
at once).
Heartbeats: WorkerStats every NITSUM_HEARTBEAT_INTERVAL_MS. SIGTERM: report `draining` (no new work is
routed here), let running requests finish, hand the rest back, exit.

With NITSUM_NODE_SIZE > 1 every worker of the node joins one process world at boot (pre-built groups for
every aligned TP group) and maps the host-wide shared weight store, so the coordinator can merge and
split groups at run time; otherwise the worker is a standalone TP=1 engine (services/worker/boot.py).
A node worker restarted after a crash boots in standby (NITSUM_NODE_STANDBY) and joins the node's re-formed
world when the coordinator sends NodeReform (services/worker/peer_loss.py); the session's backend is swapped
then, so everything reads `session.backend`.

P/D: a standalone prefill-worker (NITSUM_ROLE=prefill, or the `prefill-worker` service) runs its engine in
role "prefill" and reports role "prefill"; a RunRequest with `decode_worker` is prefilled here and handed
to that worker (services/worker/transfer.py). Every other worker serves whole requests (role "hybrid") and
adopts hand-offs. A RunRequest with `reuse_from` first fetches the prompt's cached prefix blocks from that
worker (stage 1), then prefills only the rest.

This file is the wiring: what boot builds, the subscription table and the loops; the handlers are
`WorkerService` (services/worker/service.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys

from nitsum.config import WorkerConfig
from nitsum.service import ServiceContext, run_service
from nitsum.wire.messages import (
    AbortRequest,
    NodeHandoffCommit,
    NodeHandoffOffer,
    NodeReform,
    RoleChange,
    RunRequest,
    StreamOffset,
    TopologyAbort,
    TopologyCommit,
    TopologyPrepare,
)
from nitsum_services.worker.boot import build_backend, build_engine  # noqa: F401 (build_engine: nitsum bench gateway)
from nitsum_services.worker.flow_agent import MAX_IN_FLIGHT, NODE_MAX_IN_FLIGHT, TransferAgent
from nitsum_services.worker.kv_net import KvNet
from nitsum_services.worker.migration_flows import MigrationDriver
from nitsum_services.worker.node_handoff import NodeHandoffs
from nitsum_services.worker.peer_loss import PeerLossGuard
from nitsum_services.worker.service import WorkerService
from nitsum_services.worker.session import WorkerSession
from nitsum_services.worker.transfer import KvMover

log = logging.getLogger("nitsum.worker")

DRAIN_TIMEOUT_S = 30.0
CONTROL_MESSAGES = (
    TopologyPrepare,
    TopologyCommit,
    TopologyAbort,
    RoleChange,
    NodeReform,
    StreamOffset,
)


def engine_role_of(config: WorkerConfig, service_name: str) -> str:
    """A standalone prefill worker prefills and hands off (P/D); every other group serves whole requests
        (hybrid) and adopts hand-offs. Node-world workers start hybrid: their groups' roles come with the topology
    (`TopologyPrepare`)."""
    role = config.role or ("prefill" if service_name == "prefill-worker" else "decode")
    return "prefill" if role == "prefill" and config.node_size <= 1 else "hybrid"


async def build_service(ctx: ServiceContext, service_name: str) -> WorkerService:
    config: WorkerConfig = ctx.config
    backend = await asyncio.to_thread(build_backend, config, engine_role_of(config, service_name))
    # What boot made (torch, the model, ~200k objects) lives as long as the process: out of the cyclic
    # collector's sight from now on. A full collection over it took 60-70 ms, a step's stall whenever the
    # collector's long-lived threshold tripped -- often inside a TP change, which allocates a lot.
    gc.collect()
    gc.freeze()
    ctx.state["in_world"] = backend.in_world
    bus, worker_id = ctx.bus, config.resolved_worker_id()
    session = WorkerSession(backend, bus, worker_id, ctx.metrics, ctx.tracer, config.decode_turn_ms)
    session.step_thread.prefill_delay_s = config.fault_prefill_delay_ms / 1000.0
    agent = TransferAgent(
        bus, worker_id, ctx.metrics, max_in_flight=NODE_MAX_IN_FLIGHT if backend.in_world else MAX_IN_FLIGHT
    )
    # The TCP plane of P/D hand-offs and prefix fetches between hosts. A node world's TP1 group sends over it
    # too (a hand-off to a standalone worker of another node); inside its world it moves KV over the world's
    # own plane, and the coordinator pairs no standalone prefill worker with a node-world group.
    net = kv_net_of(config, bus, worker_id, agent, ctx)
    mover = KvMover(session, agent, bus, worker_id, ctx.metrics, net=net)
    migrations = MigrationDriver(session, agent, worker_id, ctx.metrics, config.tp_migration_budget_ms)
    mover.corrupt = config.fault_kv_corrupt
    handoffs = NodeHandoffs(session, bus, worker_id, ctx.metrics)
    service = WorkerService(ctx, session, agent, mover, migrations, handoffs)
    session.on_handoff = service.on_handoff
    session.on_topology_change = service.publish_stats
    if isinstance(backend, PeerLossGuard):
        backend.on_dropped = service.requeue
    return service


def kv_net_of(config: WorkerConfig, bus, worker_id: str, agent: TransferAgent, ctx: ServiceContext) -> KvNet:
    """The TCP data plane for KV hand-offs to workers on other hosts (NITSUM_HOST_ID, NITSUM_KV_ADVERTISE_ADDR)."""
    from nitsum.node import kv_hosts

    addr = kv_hosts.advertise_addr(config.kv_advertise_addr, config.node_master_addr)
    return KvNet(bus, worker_id, kv_hosts.local_host_id(config.host_id), addr, agent.dscp, ctx.metrics)


def make_body(service_name: str):
    async def body(ctx: ServiceContext) -> None:
        service = await build_service(ctx, service_name)
        bus, worker_id = ctx.bus, service.worker_id
        await bus.subscribe(bus.subjects.worker_run(worker_id), service.on_run, expected=RunRequest)
        await bus.subscribe(
            bus.subjects.worker_control(worker_id), service.on_control, expected=CONTROL_MESSAGES, concurrent=True
        )
        await bus.subscribe(bus.subjects.abort, service.on_abort, expected=AbortRequest)
        await bus.nc.subscribe(bus.subjects.coordinator_up, cb=service.on_coordinator_up)
        await service.agent.start()
        await service.mover.start()
        await bus.subscribe(
            bus.subjects.worker_handoff(worker_id),
            service.on_handoff_message,
            expected=(NodeHandoffOffer, NodeHandoffCommit),
            concurrent=True,
        )
        engine_stop = asyncio.Event()
        tasks = {ctx.spawn(service.session.run(engine_stop), "engine"), ctx.spawn(service.heartbeat(), "heartbeat")}
        await service.publish_stats()

        async def drain() -> None:
            await service.drain(engine_stop, tasks, DRAIN_TIMEOUT_S)

        ctx.drain_hooks.append(drain)

    return body


# The step thread holds the GIL for most of a step; the event loop (NATS, permits, commands) asks for it each
# time it wakes and gets it when the holder is made to drop it, after the switch interval (5 ms by default:
# each hop of a TP change waited up to that, two or three times). The loop asks rarely, so a short interval
# costs the step thread little.
GIL_SWITCH_INTERVAL_S = 0.0005


def main(argv: list[str]) -> int:
    service_name = argv[0] if argv and argv[0] in ("prefill-worker", "decode-worker") else "decode-worker"
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    state: dict = {}
    code = run_service(
        service_name,
        WorkerConfig,
        argv[1:] if argv and argv[0] == service_name else argv,
        make_body(service_name),
        state=state,
    )
    if state.get("in_world"):
        # A peer's step thread may sit in a collective that will never complete now; do not wait for it.
        os._exit(code)
    return code
