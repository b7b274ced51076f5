"""`nitsum serve coordinator`: membership, admission, routing, worker-loss handling and the admin plane.

Owns no GPU and no durable state: on start it asks every worker for fresh stats (`coordinator_up`) and
rebuilds its tables from them, so streams in flight keep going across a coordinator restart.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nitsum.bus import BusError, RemoteError
from nitsum.config import CoordinatorConfig
from nitsum.service import ServiceContext, run_service
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import RunAck, RunRequest, SubmitReply, SubmitRequest, WorkerLost, WorkerStats
from nitsum_services.coordinator.admin import AdminPlane
from nitsum_services.coordinator.membership import Membership

log = logging.getLogger("nitsum.coordinator")

RUN_TIMEOUT_S = 2.0
EXPIRE_PERIOD_S = 0.25


class Coordinator:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.config: CoordinatorConfig = ctx.config
        self.bus = ctx.bus
        self.members = Membership(self.config.heartbeat_timeout_ms / 1000.0)
        self.policy_spec = self.config.policy
        self.epoch = 0

    def limit_for(self, tier: str) -> int:
        return self.config.queue_limit_background if tier == "background" else self.config.queue_limit_interactive

    async def on_submit(self, req: SubmitRequest, _delivery) -> SubmitReply:
        with self.ctx.tracer.start_as_current_span(
            "coordinator.route", attributes={"nitsum.request_id": req.request_id, "nitsum.tier": req.tier, "nitsum.attempt": req.attempt}
        ) as span:
            candidates = self.members.routable(exclude=req.exclude_workers)
            if not candidates:
                mark_error(span, "no_worker")
                return SubmitReply(req.request_id, False, status=503, retry_after_s=1.0, reason="no worker is ready to serve requests")
            outstanding = self.members.outstanding_by_tier().get(req.tier, 0)
            if req.attempt == 0 and outstanding >= self.limit_for(req.tier):
                mark_error(span, "queue_full")
                return SubmitReply(
                    req.request_id, False, status=429, retry_after_s=1.0, reason=f"the {req.tier} queue is full ({outstanding} requests)"
                )
            # Least loaded first; ties broken by id so that routing is deterministic.
            candidates.sort(key=lambda w: (w.load(), w.worker_id))
            reasons = []
            for record in candidates:
                worker_id = record.worker_id
                self.members.assign(req.request_id, req.tier, worker_id, time.monotonic())
                try:
                    ack = await self.bus.request(
                        self.bus.subjects.worker_run(worker_id), RunRequest(req, self.epoch), RUN_TIMEOUT_S, expected=RunAck
                    )
                except (BusError, RemoteError) as exc:
                    self.members.unassign(req.request_id, worker_id)
                    reasons.append(f"{worker_id}: {exc}")
                    continue
                if ack.accepted:
                    span.set_attribute("nitsum.worker", worker_id)
                    return SubmitReply(req.request_id, True, worker_id=worker_id, group_id=record.stats.group_id)
                self.members.unassign(req.request_id, worker_id)
                reasons.append(f"{worker_id}: {ack.reason}")
                if "exceeds the model context" in ack.reason or ack.reason == "empty prompt":
                    return SubmitReply(req.request_id, False, status=400, reason=ack.reason)
            mark_error(span, "; ".join(reasons))
            return SubmitReply(req.request_id, False, status=503, retry_after_s=1.0, reason="no worker accepted the request: " + "; ".join(reasons))

    async def on_stats(self, stats: WorkerStats, _delivery) -> None:
        self.members.on_stats(stats, time.monotonic())

    async def watch(self) -> None:
        while not self.ctx.stop.is_set():
            for worker_id, request_ids in self.members.expire(time.monotonic()):
                log.warning("worker %s lost (no heartbeat); %d request(s) to re-route", worker_id, len(request_ids))
                try:
                    await self.bus.publish(self.bus.subjects.worker_lost, WorkerLost(worker_id, request_ids, "heartbeat timeout"))
                except Exception as exc:
                    log.warning("could not announce the loss of %s: %s", worker_id, exc)
            self.update_metrics()
            try:
                await asyncio.wait_for(self.ctx.stop.wait(), timeout=EXPIRE_PERIOD_S)
            except asyncio.TimeoutError:
                pass

    def update_metrics(self) -> None:
        depth = self.members.outstanding_by_tier()
        gauge = self.ctx.metrics.queue_depth()
        for tier in ("interactive", "background"):
            gauge.labels(tier=tier).set(depth.get(tier, 0))
        tp = self.ctx.metrics.current_tp_level()
        for worker_id, record in self.members.workers.items():
            tp.labels(worker=worker_id).set(record.stats.tp)


def body(ctx: ServiceContext):
    async def start() -> None:
        coordinator = Coordinator(ctx)
        bus = ctx.bus
        admin = AdminPlane(coordinator)
        await bus.subscribe(bus.subjects.submit, coordinator.on_submit, queue="coordinator", expected=SubmitRequest, concurrent=True)
        await bus.subscribe(bus.subjects.worker_stats, coordinator.on_stats, expected=WorkerStats)
        await admin.subscribe()
        # Ask every worker for its state now, so that a restarted coordinator rebuilds its tables at once.
        await bus.publish_raw(bus.subjects.coordinator_up, b"")
        task = asyncio.create_task(coordinator.watch())

        async def stop_watch() -> None:
            await asyncio.wait({task}, timeout=2.0)

        ctx.drain_hooks.append(stop_watch)

    return start()


def main(argv: list[str]) -> int:
    return run_service("coordinator", CoordinatorConfig, argv[1:] if argv[:1] == ["coordinator"] else argv, body)
