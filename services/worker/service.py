"""`WorkerService`: one worker process on the bus -- its state, its stats and one handler per subscription.

The worker's role lives in one place, its engine (`Engine.role`: what the scheduler does with a finished
request); `WorkerService.role` reads it, the admin `role` command changes it at a step boundary, and the
session asks the same engine. A node-world worker reports its group's role, which changes with the topology
(Prepare/Commit); its P/D hand-offs go to the decode groups of its world (node_handoff.py).
Wiring (what is built at boot, the subscription table, the loops) is in main.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from nitsum.config import WorkerConfig
from nitsum.node.messages import NodeCommand
from nitsum.service import ServiceContext
from nitsum.wire.messages import (
    AbortRequest,
    NodeHandoffOffer,
    NodeReform,
    RoleChange,
    RunAck,
    RunRequest,
    StreamOffset,
    TopologyAbort,
    TopologyAck,
    TopologyCommit,
    TopologyPrepare,
    WorkerStats,
)
from nitsum.wire.node import group_id_of
from nitsum_services.worker.backend import NodeBackend
from nitsum_services.worker.boot import die_if_told, join_generation
from nitsum_services.worker.migration_flows import MigrationDriver
from nitsum_services.worker.node_handoff import NodeHandoffs
from nitsum_services.worker.peer_loss import PeerLossGuard, reform_refusal
from nitsum_services.worker.session import WorkerSession
from nitsum_services.worker.transfer import KvMover, TransferAgent

log = logging.getLogger("nitsum.worker")

CONTROL_TIMEOUT_S = 120.0
MAX_STREAM_OFFSETS = 8192  # re-submitted requests whose stream offset this worker remembers
PHASES = {TopologyPrepare: "prepare", TopologyCommit: "commit", TopologyAbort: "abort"}
ROLES = ("prefill", "decode", "hybrid")


class WorkerService:
    def __init__(
        self,
        ctx: ServiceContext,
        session: WorkerSession,
        agent: TransferAgent,
        mover: KvMover,
        migrations: MigrationDriver,
        handoffs: NodeHandoffs,
    ) -> None:
        self.ctx = ctx
        self.config: WorkerConfig = ctx.config
        self.worker_id = self.config.resolved_worker_id()
        self.instance_id = uuid.uuid4().hex[:12]
        self.session, self.agent, self.mover, self.migrations = session, agent, mover, migrations
        self.handoffs = handoffs  # P/D between the groups of this worker's node world
        self.state = "ready"  # "draining", then "stopped"
        self.reforming = 0  # the node world generation being formed here (0: none)
        self.fetches: set[asyncio.Task] = set()
        self.loop = asyncio.get_running_loop()

    @property
    def role(self) -> str:
        backend = self.session.backend
        if backend.in_world:  # its group's, as the last commit set it (a peer's too)
            return backend.runtime.role
        engine = backend.engine
        return engine.role if engine is not None else "hybrid"

    # -- stats --------------------------------------------------------------------------------------
    def stats_message(self) -> WorkerStats:
        session, config, mover = self.session, self.config, self.mover
        s = session.stats()
        backend = session.backend  # swapped when the node world is re-formed
        start, tp = backend.group
        running_ids, streamed, first_token_ages = session.progress(time.monotonic())
        ended_ids, ended_attempts = session.take_ended()
        return WorkerStats(
            worker_id=self.worker_id,
            node_id=config.node_id,
            device_index=config.device_index,
            device=config.device,
            role=self.role,
            state=self.state,
            group_id=group_id_of(config.node_id, start, tp),
            tp=tp,
            model_name=backend.model_name,
            max_model_len=backend.max_model_len,
            num_running=len(session.running),
            num_waiting=s.num_waiting,
            kv_blocks_free=s.num_kv_blocks_free,
            kv_blocks_total=s.num_kv_blocks_total,
            running_request_ids=running_ids,
            running_output_tokens=streamed,
            running_first_token_age_ms=first_token_ages,
            finished_request_ids=ended_ids,
            finished_attempts=ended_attempts,
            cached_block_hashes=tuple(s.cached_block_hashes[-256:]),  # the most recently cached (reuse hints)
            sent_unix_ms=time.time() * 1000.0,
            step_ms_ewma=session.step_ms_ewma,
            num_prefill_tokens_computed=s.num_prefill_tokens_computed,
            num_cached_prompt_tokens=s.num_cached_prompt_tokens,
            num_aborted=session.num_aborted,
            instance_id=self.instance_id,
            epoch=backend.epoch,
            in_world=backend.in_world,
            leader=backend.is_leader,
            block_size=config.block_size,
            num_kv_imported=mover.num_imported + self.handoffs.num_adopted,
            num_reused_blocks=mover.num_reused_blocks,
            num_transfer_failures=mover.num_failures + self.handoffs.num_failed,
            node_size=config.node_size if config.node_size > 1 else 0,
            generation=backend.generation,
        )

    async def publish_stats(self) -> None:
        metrics, session, bus = self.ctx.metrics, self.session, self.ctx.bus
        metrics.current_tp_level().labels(worker=self.worker_id).set(session.backend.group[1])
        metrics.worker_requests_running().labels(worker=self.worker_id).set(len(session.running))
        metrics.kv_blocks_free().labels(worker=self.worker_id).set(session.stats().num_kv_blocks_free)
        try:
            await bus.publish(bus.subjects.worker_stats, self.stats_message())
        except Exception as exc:  # NATS may be restarting; the next beat retries
            log.debug("stats not sent: %s", exc)

    def requeue(self, request_ids: list[str], why: str) -> None:
        """Step thread: the engine lost these requests (its group lost a worker). Their streams end with the
        retryable `worker_lost`, so the gateway re-submits each with the tokens it has."""
        for rid in request_ids:
            asyncio.run_coroutine_threadsafe(
                self.session.fail(rid, "worker_lost", f"its TP group lost a worker ({why}); re-queued"), self.loop
            )
        asyncio.run_coroutine_threadsafe(self.publish_stats(), self.loop)

    # -- worker.<id>.run ----------------------------------------------------------------------------
    async def on_run(self, run: RunRequest, _delivery) -> RunAck:
        rid, session = run.request.request_id, self.session
        if self.state != "ready":
            return RunAck(rid, self.worker_id, False, f"worker is {self.state}")
        problem = session.validate(run)
        in_world = session.backend.in_world
        if not problem and self.role == "prefill" and not run.decode_worker and not in_world:
            problem = "a prefill worker runs requests only with a decode worker to hand them to"
        if not problem and in_world and run.decode_worker and self.role != "prefill":
            problem = "only a prefill group hands requests to a decode worker"
        if not problem and in_world and run.decode_worker and not self.handoffs.reaches(run.decode_worker):
            problem = f"{run.decode_worker} is not the leader of a decode group of this node world"
        if not problem and run.reuse_from and in_world:
            problem = "stage-1 prefix fetches need a standalone worker"
        if problem:
            return RunAck(rid, self.worker_id, False, problem)
        if run.reuse_from and run.reuse_hashes:
            session.submit(run, hold=True)
            task = asyncio.create_task(self.fetch_then_start(run))
            self.fetches.add(task)
            task.add_done_callback(self.fetches.discard)
        else:
            session.submit(run)
        return RunAck(rid, self.worker_id, True)

    async def fetch_then_start(self, run: RunRequest) -> None:
        req = run.request
        attributes = {
            "nitsum.request_id": req.request_id,
            "nitsum.holder": run.reuse_from,
            "nitsum.blocks": len(run.reuse_hashes),
        }
        with self.ctx.tracer.start_as_current_span("worker.kv_fetch", attributes=attributes) as span:
            try:
                deadline = req.arrival_unix_ms + req.ttft_ms if req.arrival_unix_ms > 0 else None
                fetched = await self.mover.fetch(req.request_id, run.reuse_from, run.reuse_hashes, deadline)
                span.set_attribute("nitsum.fetched_blocks", fetched)
            finally:
                # Whatever the fetch did, the request runs: at worst it computes its whole prompt.
                self.session.start_held(req.request_id)

    # -- P/D: the session's callback once a prefill finished, and worker.<id>.handoff ------------------
    async def on_handoff(self, running) -> None:
        """The session's P/D callback: a node-world group hands off inside its world, a standalone worker over
        the KV mover."""
        if self.session.backend.in_world:
            await self.handoffs.hand_off(running)
        else:
            await self.mover.hand_off(running)

    async def on_handoff_message(self, msg, _delivery):
        """A prefill group of this worker's node world offers a request (reserve) or commits / cancels it."""
        if isinstance(msg, NodeHandoffOffer):
            return await self.handoffs.on_offer(msg)
        return await self.handoffs.on_commit(msg)

    # -- worker.<id>.control --------------------------------------------------------------------------
    async def on_control(self, msg, _delivery) -> TopologyAck | None:
        if isinstance(msg, RoleChange):
            return await self.change_role(msg)
        if isinstance(msg, NodeReform):
            return await self.reform(msg)
        if isinstance(msg, StreamOffset):
            self.remember_offset(msg)
            return None
        return await self.topology(msg)

    def remember_offset(self, msg: StreamOffset) -> None:
        offsets = self.session.stream_offsets
        offsets[msg.request_id] = msg.offset
        offsets.move_to_end(msg.request_id)
        while len(offsets) > MAX_STREAM_OFFSETS:
            offsets.popitem(last=False)

    async def change_role(self, msg: RoleChange) -> TopologyAck:
        if msg.role not in ROLES:
            return TopologyAck(self.worker_id, 0, False, "role", f"unknown role {msg.role!r}")
        if self.session.backend.in_world:
            return TopologyAck(
                self.worker_id,
                0,
                False,
                "role",
                "a node-world group's role changes with its topology: use set-topology (e.g. [0-1 TP2 prefill])",
            )
        previous = self.role
        # At a step boundary: requests already admitted finish under the rules they started with.
        await self.session.call(lambda backend: backend.engine.set_role(msg.role))
        await self.publish_stats()
        log.info("role %s -> %s", previous, msg.role)
        return TopologyAck(self.worker_id, 0, True, "role", f"{previous} -> {msg.role}")

    async def reform(self, msg: NodeReform) -> TopologyAck:
        """Join world generation `msg.generation` of this node (peer_loss.py): answered once this worker
        serves in it, or refused / failed with why (it then serves on exactly as before)."""
        session, config = self.session, self.config
        backend = session.backend
        problem = reform_refusal(backend, config.node_id, config.node_size, msg, bool(self.reforming))
        if problem:
            log.warning("re-formation of generation %d refused: %s", msg.generation, problem)
            return TopologyAck(self.worker_id, msg.generation, False, "reform", problem)
        self.reforming = msg.generation
        t0 = time.perf_counter()
        attributes = {"nitsum.generation": msg.generation, "nitsum.worker": self.worker_id}
        with self.ctx.tracer.start_as_current_span("worker.reform", attributes=attributes) as span:
            try:
                await self._join(backend, msg.generation)
            except Exception as exc:  # the rendezvous or the runtime's exchange failed: serve on as before
                why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
                span.set_attribute("nitsum.error", why)
                log.error("re-formation of generation %d failed: %s", msg.generation, why)
                await self.publish_stats()
                return TopologyAck(
                    self.worker_id, msg.generation, False, "reform", f"generation {msg.generation} not formed: {why}"
                )
            finally:
                self.reforming = 0
        self.ctx.state["in_world"] = True
        if isinstance(backend, NodeBackend):
            await asyncio.to_thread(backend.runtime.close)  # the old world's KV receiver and segments
        ms = (time.perf_counter() - t0) * 1000.0
        log.info(
            "joined node %s world generation %d (%d workers) in %.0f ms; %d request(s) kept running",
            config.node_id,
            msg.generation,
            config.node_size,
            ms,
            len(session.running),
        )
        await self.publish_stats()
        return TopologyAck(self.worker_id, msg.generation, True, "reform", f"generation {msg.generation}", ms)

    async def _join(self, backend, generation: int) -> None:
        """Form the new generation's backend and swap it in at a step boundary; on failure whatever was formed
        goes again (and an old world destroyed to make room for it is marked lost)."""
        new = None
        try:
            new = await asyncio.to_thread(join_generation, self.config, backend, generation)
            new.on_dropped = self.requeue

            def swap(current):
                # At a step boundary: the next iteration steps the same engine through the new backend.
                assert current is backend, "the backend changed while the node world was re-formed"
                self.session.backend = new
                return new

            await self.session.call(swap)
        except Exception as exc:
            if new is not None and self.session.backend is not new:  # formed but not taken: it goes again
                new.runtime.close()
                new.runtime.world.destroy()
                if isinstance(backend, NodeBackend) and not backend.runtime.world_lost:
                    backend.runtime.world_lost = f"re-formation failed: {exc}"  # its old world went too
            raise

    async def topology(self, msg: TopologyPrepare | TopologyCommit | TopologyAbort) -> TopologyAck:
        """Prepare / Commit / Abort of a TP change, at this group's leader."""
        backend, phase = self.session.backend, PHASES[type(msg)]
        refuse = lambda why: TopologyAck(self.worker_id, msg.epoch, False, phase, why)  # noqa: E731
        if self.reforming:
            return refuse(f"this worker is joining node world generation {self.reforming}")
        if not isinstance(backend, NodeBackend):
            return refuse(
                "this worker is not in a node world (NITSUM_NODE_SIZE; a restarted one waits for the "
                "node's re-formation)"
            )
        assigned = sorted(msg.groups, key=lambda g: g.start) if phase == "prepare" else []
        groups = tuple((g.start, g.tp) for g in assigned)
        if any(g.role not in ROLES for g in assigned):
            return refuse(f"unknown role in {[g.role for g in assigned]}; roles: {', '.join(ROLES)}")
        roles = tuple(g.role for g in assigned)
        leaders = tuple(g.worker_ids[0] if g.worker_ids else "" for g in assigned)
        refused = backend.refusal(phase, msg.epoch, groups) if isinstance(backend, PeerLossGuard) else ""
        if refused:
            return refuse(refused)
        if phase == "commit":
            die_if_told(self.config, "commit", msg.epoch)
        # The coordinator sends commands to the leaders of the topology it just committed; a peer promoted
        # by that commit may still be finishing it in its step thread. Give it a moment before refusing
        # (a refusal would leave the other leaders waiting in the prepare's collective).
        deadline = time.monotonic() + 5.0
        while not backend.is_leader and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not backend.is_leader:
            return refuse("commands enter a group through its leader")
        attributes = {"nitsum.epoch": msg.epoch, "nitsum.worker": self.worker_id}
        with self.ctx.tracer.start_as_current_span(f"worker.topology.{phase}", attributes=attributes) as span:
            try:
                ack = await asyncio.wait_for(
                    self.session.control(NodeCommand(phase, msg.epoch, groups, roles=roles, leaders=leaders)),
                    CONTROL_TIMEOUT_S,
                )
                if ack.pending:  # KV pre-copy runs between decode steps, under stage-M flow permits
                    ack = await asyncio.wait_for(self.migrations.drive(msg, ack), CONTROL_TIMEOUT_S)
            except (TimeoutError, RuntimeError) as exc:
                span.set_attribute("nitsum.error", str(exc))
                return refuse(f"{type(exc).__name__}: {exc}")
            span.set_attribute("nitsum.ok", ack.ok)
            if not ack.ok:
                span.set_attribute("nitsum.error", ack.reason)
            if phase == "commit" and ack.ok:
                timings = backend.runtime.last_commit_timings_ms
                for name, ms in timings.items():
                    span.set_attribute(f"nitsum.commit_{name}_ms", round(ms, 3))
                log.info(
                    "epoch %d: commit %.1f ms (%s), %d bytes moved",
                    msg.epoch,
                    ack.duration_ms,
                    ", ".join(f"{k} {v:.0f}" for k, v in timings.items()),
                    ack.bytes_moved,
                )
        if phase in ("prepare", "commit") and ack.ok:
            self.ctx.metrics.kv_migration_bytes_total().inc(ack.bytes_moved)
            for path, size in ack.bytes_by_path:
                self.migrations.count_bytes(path, size)
        return TopologyAck(self.worker_id, ack.epoch, ack.ok, ack.phase, ack.reason, ack.duration_ms)

    # -- the abort broadcast, coordinator_up, heartbeats, drain ---------------------------------------
    async def on_abort(self, msg: AbortRequest, _delivery) -> None:
        if msg.worker_id and msg.worker_id != self.worker_id:
            return
        if self.session.abort(msg.request_id, msg.reason):
            log.info("aborted %s (%s)", msg.request_id, msg.reason)

    async def on_coordinator_up(self, _msg) -> None:
        await self.publish_stats()

    async def heartbeat(self) -> None:
        """WorkerStats every heartbeat interval, and sooner once many streams ended since the last one: the
        coordinator counts a request against its tier's queue bound until it hears its stream ended."""
        period_s = self.config.heartbeat_interval_ms / 1000.0
        while not self.ctx.stop.is_set():
            await self.publish_stats()
            waits = [asyncio.ensure_future(self.ctx.stop.wait()), asyncio.ensure_future(self.session.many_ended.wait())]
            try:
                await asyncio.wait(waits, timeout=period_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def drain(self, engine_stop: asyncio.Event, tasks: set[asyncio.Task], timeout_s: float) -> None:
        """Report `draining` (no new work is routed here), let running requests finish, hand the rest back."""
        session = self.session
        self.state = "draining"
        await self.publish_stats()
        deadline = time.monotonic() + timeout_s
        while not session.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not session.idle:
            # Hand the rest back: the gateway re-routes them with the tokens they already have.
            await session.fail_all("worker_stopping", "the worker is shutting down")
        self.state = "stopped"
        await self.publish_stats()
        engine_stop.set()
        await asyncio.wait(tasks, timeout=5.0)
        await session.publisher.close()  # the last frames (the failures just reported) reach NATS before it drains
        await self.mover.aclose()
        if isinstance(session.backend, NodeBackend):
            session.backend.runtime.close()  # no KV segment of this worker stays in /dev/shm
