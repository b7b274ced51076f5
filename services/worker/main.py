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
then, so everything here reads `session.backend`.

P/D: a standalone prefill-worker (NITSUM_ROLE=prefill, or the `prefill-worker` service) runs its engine in
role "prefill" and reports role "prefill"; a RunRequest with `decode_worker` is prefilled here and handed
to that worker (services/worker/transfer.py). Every other worker serves whole requests (role "hybrid") and
adopts hand-offs. A RunRequest with `reuse_from` first fetches the prompt's cached prefix blocks from that
worker (stage 1), then prefills only the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import sys
import time
import uuid

from nitsum.config import WorkerConfig
from nitsum.service import ServiceContext, run_service
from nitsum.wire.messages import AbortRequest, NodeReform, RoleChange, RunAck, RunRequest, StreamOffset, TopologyAbort, TopologyAck, TopologyCommit, TopologyPrepare, WorkerStats
from nitsum_services.worker.backend import NodeBackend
from nitsum_services.worker.boot import build_backend, build_engine, die_if_told, join_generation  # noqa: F401 (build_engine: nitsum bench gateway)
from nitsum_services.worker.migration_flows import MigrationDriver
from nitsum_services.worker.peer_loss import PeerLossGuard, reform_refusal
from nitsum_services.worker.session import WorkerSession
from nitsum_services.worker.transfer import MAX_IN_FLIGHT, NODE_MAX_IN_FLIGHT, KvMover, TransferAgent

log = logging.getLogger("nitsum.worker")

DRAIN_TIMEOUT_S = 30.0
CONTROL_TIMEOUT_S = 120.0
MAX_STREAM_OFFSETS = 8192  # re-submitted requests whose stream offset this worker remembers


def group_id_of(node_id: str, start: int, tp: int) -> str:
    return f"{node_id}-g{start}-tp{tp}"


def make_body(service_name: str):
    async def body(ctx: ServiceContext) -> None:
        config: WorkerConfig = ctx.config
        role = config.role or ("prefill" if service_name == "prefill-worker" else "decode")
        # A standalone prefill worker prefills and hands off (P/D); every other group serves whole requests
        # (hybrid) and adopts hand-offs. Node-world workers stay hybrid: their groups change at run time.
        engine_role = "prefill" if role == "prefill" and config.node_size <= 1 else "hybrid"
        roles = {"engine": engine_role}  # changed at run time by the admin `role` command
        worker_id = config.resolved_worker_id()
        instance_id = uuid.uuid4().hex[:12]
        backend = await asyncio.to_thread(build_backend, config, engine_role)
        # What boot made (torch, the model, ~200k objects) lives as long as the process: out of the cyclic
        # collector's sight from now on. A full collection over it took 60-70 ms, a step's stall whenever the
        # collector's long-lived threshold tripped -- often inside a TP change, which allocates a lot.
        gc.collect()
        gc.freeze()
        ctx.state["in_world"] = backend.in_world
        bus = ctx.bus
        session = WorkerSession(backend, bus, worker_id, ctx.metrics, ctx.tracer)
        session.prefill_role = engine_role == "prefill"
        agent = TransferAgent(bus, worker_id, ctx.metrics, max_in_flight=NODE_MAX_IN_FLIGHT if backend.in_world else MAX_IN_FLIGHT)
        mover = KvMover(session, agent, bus, worker_id, ctx.metrics)
        migrations = MigrationDriver(session, agent, worker_id, ctx.metrics, config.tp_migration_budget_ms)
        mover.corrupt = config.fault_kv_corrupt
        session.on_handoff = mover.hand_off
        state = {"value": "ready"}

        def stats_message() -> WorkerStats:
            s = session.stats()
            backend = session.backend  # swapped when the node world is re-formed
            start, tp = backend.group
            return WorkerStats(
                worker_id=worker_id,
                node_id=config.node_id,
                device_index=config.device_index,
                device=config.device,
                role=roles["engine"],
                state=state["value"],
                group_id=group_id_of(config.node_id, start, tp),
                tp=tp,
                model_name=backend.model_name,
                max_model_len=backend.max_model_len,
                num_running=len(session.running),
                num_waiting=s.num_waiting,
                kv_blocks_free=s.num_kv_blocks_free,
                kv_blocks_total=s.num_kv_blocks_total,
                running_request_ids=tuple(session.running),
                cached_block_hashes=tuple(s.cached_block_hashes[-256:]),  # the most recently cached (reuse hints)
                sent_unix_ms=time.time() * 1000.0,
                step_ms_ewma=session.step_ms_ewma,
                num_prefill_tokens_computed=s.num_prefill_tokens_computed,
                num_cached_prompt_tokens=s.num_cached_prompt_tokens,
                num_aborted=session.num_aborted,
                instance_id=instance_id,
                epoch=backend.epoch,
                in_world=backend.in_world,
                leader=backend.is_leader,
                block_size=config.block_size,
                num_kv_imported=mover.num_imported,
                num_reused_blocks=mover.num_reused_blocks,
                num_transfer_failures=mover.num_failures,
                node_size=config.node_size if config.node_size > 1 else 0,
                generation=backend.generation,
            )

        async def publish_stats() -> None:
            ctx.metrics.current_tp_level().labels(worker=worker_id).set(session.backend.group[1])
            ctx.metrics.worker_requests_running().labels(worker=worker_id).set(len(session.running))
            ctx.metrics.kv_blocks_free().labels(worker=worker_id).set(session.stats().num_kv_blocks_free)
            try:
                await bus.publish(bus.subjects.worker_stats, stats_message())
            except Exception as exc:  # NATS may be restarting; the next beat retries
                log.debug("stats not sent: %s", exc)

        session.on_topology_change = publish_stats

        loop = asyncio.get_running_loop()

        def requeue(request_ids: list[str], why: str) -> None:
            """Step thread: the engine lost these requests (its group lost a worker). Their streams end
            with the retryable `worker_lost`, so the gateway re-submits each with the tokens it has."""
            for rid in request_ids:
                asyncio.run_coroutine_threadsafe(session.fail(rid, "worker_lost", f"its TP group lost a worker ({why}); re-queued"), loop)
            asyncio.run_coroutine_threadsafe(publish_stats(), loop)

        if isinstance(backend, PeerLossGuard):
            backend.on_dropped = requeue

        async def on_run(run: RunRequest, _delivery) -> RunAck:
            rid = run.request.request_id
            if state["value"] != "ready":
                return RunAck(rid, worker_id, False, f"worker is {state['value']}")
            problem = session.validate(run)
            if not problem and roles["engine"] == "prefill" and not run.decode_worker:
                problem = "a prefill worker runs requests only with a decode worker to hand them to"
            if not problem and (run.decode_worker or run.reuse_from) and session.backend.in_world:
                problem = "KV hand-offs need a standalone worker"
            if problem:
                return RunAck(rid, worker_id, False, problem)
            if run.reuse_from and run.reuse_hashes:
                session.submit(run, hold=True)
                task = asyncio.create_task(fetch_then_start(run))
                fetches.add(task)
                task.add_done_callback(fetches.discard)
            else:
                session.submit(run)
            return RunAck(rid, worker_id, True)

        fetches: set[asyncio.Task] = set()

        async def fetch_then_start(run: RunRequest) -> None:
            req = run.request
            with ctx.tracer.start_as_current_span("worker.kv_fetch", attributes={"nitsum.request_id": req.request_id, "nitsum.holder": run.reuse_from, "nitsum.blocks": len(run.reuse_hashes)}) as span:
                try:
                    deadline = req.arrival_unix_ms + req.ttft_ms if req.arrival_unix_ms > 0 else None
                    span.set_attribute("nitsum.fetched_blocks", await mover.fetch(req.request_id, run.reuse_from, run.reuse_hashes, deadline))
                finally:
                    # Whatever the fetch did, the request runs: at worst it computes its whole prompt.
                    session.start_held(req.request_id)

        async def change_role(msg: RoleChange) -> TopologyAck:
            if msg.role not in ("prefill", "decode", "hybrid"):
                return TopologyAck(worker_id, 0, False, "role", f"unknown role {msg.role!r}")
            if session.backend.in_world:
                return TopologyAck(worker_id, 0, False, "role", "workers in a node world serve hybrid groups; change the topology instead")

            def apply(b) -> None:
                # At a step boundary: requests already admitted finish under the rules they started with.
                engine = b.engine
                engine.cfg = dataclasses.replace(engine.cfg, role=msg.role)
                engine.scheduler.role = msg.role

            await session.call(apply)
            previous, roles["engine"] = roles["engine"], msg.role
            session.prefill_role = msg.role == "prefill"
            await publish_stats()
            log.info("role %s -> %s", previous, msg.role)
            return TopologyAck(worker_id, 0, True, "role", f"{previous} -> {msg.role}")

        reforming = {"generation": 0}  # the generation being formed here (0: none)

        async def reform(msg: NodeReform) -> TopologyAck:
            """Join world generation `msg.generation` of this node (peer_loss.py): answered once this worker
            serves in it, or refused / failed with why (it then serves on exactly as before)."""
            backend = session.backend
            problem = reform_refusal(backend, config.node_id, config.node_size, msg, bool(reforming["generation"]))
            if problem:
                log.warning("re-formation of generation %d refused: %s", msg.generation, problem)
                return TopologyAck(worker_id, msg.generation, False, "reform", problem)
            reforming["generation"] = msg.generation
            t0 = time.perf_counter()
            with ctx.tracer.start_as_current_span("worker.reform", attributes={"nitsum.generation": msg.generation, "nitsum.worker": worker_id}) as span:
                new = None
                try:
                    new = await asyncio.to_thread(join_generation, config, backend, msg.generation)
                    new.on_dropped = requeue

                    def swap(current):
                        # At a step boundary: the next iteration steps the same engine through the new backend.
                        assert current is backend, "the backend changed while the node world was re-formed"
                        session.backend = new
                        return new

                    await session.call(swap)
                except Exception as exc:  # the rendezvous or the runtime's exchange failed: serve on as before
                    if new is not None and session.backend is not new:  # formed but not taken: it goes again
                        new.runtime.close()
                        new.runtime.world.destroy()
                        if isinstance(backend, NodeBackend) and not backend.runtime.world_lost:
                            backend.runtime.world_lost = f"re-formation failed: {exc}"  # its old world went too
                    why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
                    span.set_attribute("nitsum.error", why)
                    log.error("re-formation of generation %d failed: %s", msg.generation, why)
                    await publish_stats()
                    return TopologyAck(worker_id, msg.generation, False, "reform", f"generation {msg.generation} not formed: {why}")
                finally:
                    reforming["generation"] = 0
            ctx.state["in_world"] = True
            if isinstance(backend, NodeBackend):
                await asyncio.to_thread(backend.runtime.close)  # the old world's KV receiver and segments
            ms = (time.perf_counter() - t0) * 1000.0
            log.info("joined node %s world generation %d (%d workers) in %.0f ms; %d request(s) kept running",
                     config.node_id, msg.generation, config.node_size, ms, len(session.running))
            await publish_stats()
            return TopologyAck(worker_id, msg.generation, True, "reform", f"generation {msg.generation}", ms)

        async def on_control(msg, _delivery) -> TopologyAck:
            if isinstance(msg, RoleChange):
                return await change_role(msg)
            if isinstance(msg, NodeReform):
                return await reform(msg)
            if isinstance(msg, StreamOffset):
                session.stream_offsets[msg.request_id] = msg.offset
                session.stream_offsets.move_to_end(msg.request_id)
                while len(session.stream_offsets) > MAX_STREAM_OFFSETS:
                    session.stream_offsets.popitem(last=False)
                return None
            backend = session.backend
            phase = {TopologyPrepare: "prepare", TopologyCommit: "commit", TopologyAbort: "abort"}[type(msg)]
            if reforming["generation"]:
                return TopologyAck(worker_id, msg.epoch, False, phase, f"this worker is joining node world generation {reforming['generation']}")
            if not isinstance(backend, NodeBackend):
                return TopologyAck(worker_id, msg.epoch, False, phase, "this worker is not in a node world (NITSUM_NODE_SIZE; a restarted one waits for the node's re-formation)")
            groups = tuple(sorted((g.start, g.tp) for g in msg.groups)) if phase == "prepare" else ()
            refused = backend.refusal(phase, msg.epoch, groups) if isinstance(backend, PeerLossGuard) else ""
            if refused:
                return TopologyAck(worker_id, msg.epoch, False, phase, refused)
            if phase == "commit":
                die_if_told(config, "commit", msg.epoch)
            # The coordinator sends commands to the leaders of the topology it just committed; a peer promoted
            # by that commit may still be finishing it in its step thread. Give it a moment before refusing
            # (a refusal would leave the other leaders waiting in the prepare's collective).
            deadline = time.monotonic() + 5.0
            while not backend.is_leader and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if not backend.is_leader:
                return TopologyAck(worker_id, msg.epoch, False, phase, "commands enter a group through its leader")
            from nitsum.node.runtime import NodeCommand

            with ctx.tracer.start_as_current_span(f"worker.topology.{phase}", attributes={"nitsum.epoch": msg.epoch, "nitsum.worker": worker_id}) as span:
                try:
                    ack = await asyncio.wait_for(session.control(NodeCommand(phase, msg.epoch, groups)), CONTROL_TIMEOUT_S)
                    if ack.pending:  # KV pre-copy runs between decode steps, under stage-M flow permits
                        ack = await asyncio.wait_for(migrations.drive(msg, ack), CONTROL_TIMEOUT_S)
                except (asyncio.TimeoutError, RuntimeError) as exc:
                    span.set_attribute("nitsum.error", str(exc))
                    return TopologyAck(worker_id, msg.epoch, False, phase, f"{type(exc).__name__}: {exc}")
                span.set_attribute("nitsum.ok", ack.ok)
                if not ack.ok:
                    span.set_attribute("nitsum.error", ack.reason)
                if phase == "commit" and ack.ok:
                    timings = getattr(backend.runtime, "last_commit_timings_ms", {})
                    for name, ms in timings.items():
                        span.set_attribute(f"nitsum.commit_{name}_ms", round(ms, 3))
                    log.info("epoch %d: commit %.1f ms (%s), %d bytes moved", msg.epoch, ack.duration_ms,
                             ", ".join(f"{k} {v:.0f}" for k, v in timings.items()), ack.bytes_moved)
            if phase in ("prepare", "commit") and ack.ok:
                ctx.metrics.kv_migration_bytes_total().inc(ack.bytes_moved)
                for path, size in ack.bytes_by_path:
                    migrations.count_bytes(path, size)
            return TopologyAck(worker_id, ack.epoch, ack.ok, ack.phase, ack.reason, ack.duration_ms)

        async def on_abort(msg: AbortRequest, _delivery) -> None:
            if msg.worker_id and msg.worker_id != worker_id:
                return
            if session.abort(msg.request_id, msg.reason):
                log.info("aborted %s (%s)", msg.request_id, msg.reason)

        async def on_coordinator_up(_msg) -> None:
            await publish_stats()

        async def heartbeat() -> None:
            period_s = config.heartbeat_interval_ms / 1000.0
            while not ctx.stop.is_set():
                await publish_stats()
                try:
                    await asyncio.wait_for(ctx.stop.wait(), timeout=period_s)
                except asyncio.TimeoutError:
                    pass

        await bus.subscribe(bus.subjects.worker_run(worker_id), on_run, expected=RunRequest)
        await bus.subscribe(bus.subjects.worker_control(worker_id), on_control, expected=(TopologyPrepare, TopologyCommit, TopologyAbort, RoleChange, NodeReform, StreamOffset), concurrent=True)
        await bus.subscribe(bus.subjects.abort, on_abort, expected=AbortRequest)
        await bus.nc.subscribe(bus.subjects.coordinator_up, cb=on_coordinator_up)
        await agent.start()
        await mover.start()
        engine_stop = asyncio.Event()
        loop_task = ctx.spawn(session.run(engine_stop), "engine")
        beat_task = ctx.spawn(heartbeat(), "heartbeat")
        await publish_stats()

        async def drain() -> None:
            state["value"] = "draining"
            await publish_stats()
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while not session.idle and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if not session.idle:
                # Hand the rest back: the gateway re-routes them with the tokens they already have.
                await session._fail_all("worker_stopping", "the worker is shutting down")
            state["value"] = "stopped"
            await publish_stats()
            engine_stop.set()
            await asyncio.wait({loop_task, beat_task}, timeout=5.0)
            mover.close()
            if isinstance(session.backend, NodeBackend):
                session.backend.runtime.close()  # no KV segment of this worker stays in /dev/shm

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
    code = run_service(service_name, WorkerConfig, argv[1:] if argv and argv[0] == service_name else argv, make_body(service_name), state=state)
    if state.get("in_world"):
        # A peer's step thread may sit in a collective that will never complete now; do not wait for it.
        os._exit(code)
    return code
