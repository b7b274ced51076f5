"""`WorkerService`: one worker process on the bus -- its state, its stats and one handler per subscription.

The worker's role lives in one place, its engine (`Engine.role`: what the scheduler does with a finished
request); `WorkerService.role` reads it, the admin `role` command changes it at a step boundary, and the
session asks the same engine. A node-world worker reports its group's role, which changes with the topology
(Prepare/Commit); its P/D hand-offs go to the decode groups of its world (node_handoff.py).
Wiring (what is built at boot, the subscription table, the loops) is in main.py; the control handlers
(role, re-formation, TP changes) are control.py's `WorkerControl`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from nitsum.config import WorkerConfig
from nitsum.node import spread_kv
from nitsum.service import ServiceContext
from nitsum.wire.messages import (
    AbortRequest,
    NodeHandoffOffer,
    RunAck,
    RunRequest,
    WorkerStats,
)
from nitsum.wire.node import group_id_of
from nitsum_services.worker.backend import NodeBackend
from nitsum_services.worker.control import WorkerControl
from nitsum_services.worker.migration_flows import MigrationDriver
from nitsum_services.worker.node_handoff import NodeHandoffs
from nitsum_services.worker.prefill_admission import PrefillAdmissions
from nitsum_services.worker.session import WorkerSession
from nitsum_services.worker.transfer import KvMover, TransferAgent

log = logging.getLogger("nitsum.worker")


class WorkerService(WorkerControl):
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
        # the overload check on arrival
        self.admissions = PrefillAdmissions(
            session, ctx.bus, self.worker_id, self.instance_id, block_size=self.config.block_size
        )
        session.on_prefill_over = self.admissions.prefill_over
        agent.on_request_pruned = self.admissions.on_pruned
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

    @property
    def kv_gather(self) -> bool:
        """This worker leads a TP>1 group whose members' KV heads it can gather and scatter (shm arenas)."""
        backend = self.session.backend
        return backend.in_world and spread_kv.capable(backend.runtime)

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
            kv_gather=self.kv_gather,
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
        # a TP>1 group's KV heads are spread over its members: the KV mover (another node, prefix fetches) applies
        # to it only where its leader can gather and scatter them (shm arenas: `kv_gather`); a TP1 group's leader
        # holds them all, like a standalone worker
        spread = in_world and session.backend.group[1] != 1 and not self.kv_gather
        if not problem and self.role == "prefill" and not run.decode_worker and not in_world:
            problem = "a prefill worker runs requests only with a decode worker to hand them to"
        if not problem and in_world and run.decode_worker and self.role != "prefill":
            problem = "only a prefill group hands requests to a decode worker"
        if not problem and spread and run.decode_worker and not self.handoffs.reaches(run.decode_worker):
            problem = (
                f"{run.decode_worker} is not the leader of a decode group of this node world, and this TP>1 group "
                "cannot gather its KV heads for another host (its world's KV path is not shared memory)"
            )
        if not problem and run.reuse_from and spread:
            problem = "stage-1 prefix fetches need a standalone worker, a TP1 group or a TP>1 group on shm arenas"
        if problem:
            return RunAck(rid, self.worker_id, False, problem)
        if run.reuse_from and run.reuse_hashes:
            session.submit(run, hold=True)
            task = asyncio.create_task(self.fetch_then_start(run))
            self.fetches.add(task)
            task.add_done_callback(self.fetches.discard)
        else:
            session.submit(run)
        self.admissions.admitted(run)
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
        the KV mover; so does a node world's TP1 group whose decode worker the coordinator named outside its world
        (another node: TCP between hosts), its leader's cache holding every head of the request, and a TP>1 group's
        leader that gathers its members' heads from their shm arenas (`nitsum.node.spread_kv`)."""
        backend = self.session.backend
        dst = running.decode_worker
        one_cache = backend.group[1] == 1 or self.kv_gather  # (a TP>1 group's leader gathers its members' heads)
        if not backend.in_world or (dst and not self.handoffs.reaches(dst) and one_cache):
            await self.mover.hand_off(running)
        else:
            await self.handoffs.hand_off(running)

    async def on_handoff_message(self, msg, _delivery):
        """A prefill group of this worker's node world offers a request (reserve) or commits / cancels it."""
        if isinstance(msg, NodeHandoffOffer):
            return await self.handoffs.on_offer(msg)
        return await self.handoffs.on_commit(msg)

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
