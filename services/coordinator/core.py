"""The coordinator's core: admission, routing and policy epochs over the membership tables.

Every decision is made by the same `nitsum.policy` objects the simulator runs: the coordinator builds a
ClusterSnapshot (membership + requests in flight), asks the policy, and carries the answer out.

P/D: when the mesh has standalone prefill workers (role "prefill") and standalone hybrid workers, a fresh
request is prefilled on a prefill worker and handed to the least loaded hybrid worker of its node, else of
another node (`RunRequest.decode_worker`; between hosts the KV goes over the TCP data plane); re-submitted
requests (a failed or pruned hand-off, a lost worker) run hybrid.
Inside a node world the same holds between groups: a prefill group's leader hands to the least
loaded leader of a decode group of its world (a hybrid one when it has none), its KV moving cache to
cache (nitsum.node.handoff).
KV reuse (stage 1): when another worker of the node has cached more of the prompt's prefix blocks than the
chosen one (WorkerStats.cached_block_hashes), the chosen one is told to fetch them first (`reuse_from`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback

from nitsum.bus import BusError, RemoteError
from nitsum.config import CoordinatorConfig
from nitsum.policy.registry import layout_problem, make_policy
from nitsum.policy.snapshot import ClusterSnapshot, NodeView
from nitsum.service import ServiceContext
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import (
    AbortRequest,
    RunAck,
    RunRequest,
    StreamOffset,
    SubmitReply,
    SubmitRequest,
    WorkerLost,
    WorkerStats,
)
from nitsum_services.coordinator.liveness import LivenessWatch
from nitsum_services.coordinator.membership import Membership
from nitsum_services.coordinator.policy_setup import policy_config
from nitsum_services.coordinator.reform import ReformAgent
from nitsum_services.coordinator.routing import note_arrival, pd_plan, request_view, reuse_hint
from nitsum_services.coordinator.snapshot import build_snapshot, fitting_max_tp, live_arrival_window
from nitsum_services.coordinator.transition import TransitionAgent, TransitionError

EVENT_EPOCH_GAP_S = 0.05  # epochs a queue event triggers run at most this often (the periodic one as configured)

log = logging.getLogger("nitsum.coordinator")


class Coordinator:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.config: CoordinatorConfig = ctx.config
        self.bus = ctx.bus
        self.members = Membership(self.config.heartbeat_timeout_ms / 1000.0)
        self.policy_spec = self.config.policy
        self.policy = make_policy(self.policy_spec, policy_config(self.config))
        self.last_decisions: list[dict] = []
        self.epoch_problem = ""  # the last epoch's failure, logged once until an epoch succeeds again
        self.unfit_warned: set[tuple[str, str]] = set()  # (node, policy) whose layout the node cannot hold
        self.last_reconfig_ms: dict[str, float] = {}
        self.transitions = TransitionAgent(self)
        self.reforms = ReformAgent(self)  # re-forms a node world that lost a member (services/coordinator/reform.py)
        # Nodes whose topology an operator set by hand: the policy leaves them alone until the next set-policy.
        self.pinned_nodes: set[str] = set()
        self.arrivals = live_arrival_window(self.now_ms())
        self.shed_asked: set[str] = set()  # requests an epoch asked the workers to shed, while not yet prefilled
        # Set on queue events that should not wait for the next epoch (a latency-tier request arrives while
        # its tier already has work queued): the policy looks again at once.
        self.trigger = asyncio.Event()
        self.liveness = LivenessWatch(self)  # declares silent workers lost (`watch`)

    # ---- policy ----------------------------------------------------------------------------------
    @staticmethod
    def now_ms() -> float:
        return time.monotonic() * 1000.0

    def snapshot(self) -> ClusterSnapshot:
        now_ms = self.now_ms()
        return build_snapshot(
            self.members,
            now_ms,
            self.config.max_tp,
            self.config.min_tp,
            self.config.device_kind,
            self.last_reconfig_ms,
            self.arrivals,
        )

    def full_nodes(self) -> list[NodeView]:
        """Every known node at its full size (the `node_size` its workers report; a standalone worker: 1), not
        as many devices as happen to be registered now (a worker restarting, or not up yet at boot)."""
        sizes: dict[str, int] = {}
        for record in self.members.workers.values():
            s = record.stats
            sizes[s.node_id] = max(sizes.get(s.node_id, 1), s.node_size, s.device_index + 1)
        views = []
        for node_id, size in sorted(sizes.items()):
            max_tp = fitting_max_tp(size, self.config.max_tp)
            views.append(NodeView(node_id, size, min(self.config.min_tp, max_tp), max_tp, (), self.config.device_kind))
        return views

    def set_policy(self, spec: str) -> str:
        """Switch policy; '' on success, else why not (nothing changes)."""
        try:
            policy = make_policy(spec, policy_config(self.config))
        except (ValueError, TypeError) as exc:
            return str(exc)
        for node in self.full_nodes():  # a layout a node cannot hold is refused now, not retried forever
            problem = layout_problem(policy, node)
            if problem:
                return f"{spec} does not fit node {node.node_id} ({node.num_devices} devices): {problem}"
        self.policy, self.policy_spec = policy, spec
        self.pinned_nodes.clear()  # a policy chosen by hand takes the nodes back
        return ""

    def limit_for(self, tier: str) -> int:
        return self.config.queue_limit_background if tier == "background" else self.config.queue_limit_interactive

    # ---- request path ----------------------------------------------------------------------------
    async def on_submit(self, req: SubmitRequest, _delivery) -> SubmitReply:
        with self.ctx.tracer.start_as_current_span(
            "coordinator.route",
            attributes={"nitsum.request_id": req.request_id, "nitsum.tier": req.tier, "nitsum.attempt": req.attempt},
        ) as span:
            candidates = self.members.routable(exclude=req.exclude_workers)
            if not candidates:
                mark_error(span, "no_worker")
                return SubmitReply(
                    req.request_id, False, status=503, retry_after_s=1.0, reason="no worker is ready to serve requests"
                )
            now_ms = self.now_ms()
            view = request_view(req, now_ms)
            if req.attempt == 0 and req.ttft_ms <= 1000.0 and self.members.outstanding_by_tier().get(req.tier, 0) > 0:
                self.trigger.set()
            if req.attempt == 0:
                note_arrival(self.arrivals, view)
            snap = self.snapshot()
            if req.attempt == 0:
                outstanding = self.members.outstanding_by_tier().get(req.tier, 0)
                if outstanding >= self.limit_for(req.tier):
                    mark_error(span, "queue_full")
                    return SubmitReply(
                        req.request_id,
                        False,
                        status=429,
                        retry_after_s=1.0,
                        reason=f"the {req.tier} queue is full ({outstanding} requests)",
                    )
                admission = self.policy.admit(snap, view)
                if not admission.admit:
                    mark_error(span, f"rejected: {admission.reason}")
                    return SubmitReply(
                        req.request_id,
                        False,
                        status=admission.status,
                        retry_after_s=admission.retry_after_s,
                        reason=admission.reason,
                    )
            decision = self.policy.route(snap, view)
            span.set_attribute("nitsum.route_reason", decision.reason)
            # The policy's group first; the rest by load, so that a refusal still finds a home. P/D pairs
            # (a prefill worker and its decode worker) come before hybrid workers when the mesh has them.
            plan = pd_plan(req, candidates, decision.group_id)
            holders = self.members.routable()  # a worker excluded from running it may still serve its prefix
            reasons = []
            told: set[str] = set()  # nodes whose workers know this re-submitted request's stream offset
            for record, decode_worker in plan:
                worker_id = record.worker_id
                if req.output_token_ids and record.stats.node_size > 1 and record.stats.node_id not in told:
                    told.add(record.stats.node_id)
                    await self.announce_offset(req, record.stats.node_id)
                reuse_from, reuse_hashes = reuse_hint(req, record, holders)
                if decode_worker:
                    span.set_attribute("nitsum.decode_worker", decode_worker)
                if reuse_from:
                    span.set_attribute("nitsum.reuse_from", reuse_from)
                    span.set_attribute("nitsum.reuse_blocks", len(reuse_hashes))
                self.members.assign(
                    req.request_id, req.tier, worker_id, time.monotonic(), view, len(req.output_token_ids), req.attempt
                )
                run = RunRequest(req, decode_worker=decode_worker, reuse_from=reuse_from, reuse_hashes=reuse_hashes)
                try:
                    ack = await self.bus.request(
                        self.bus.subjects.worker_run(worker_id), run, self.config.run_timeout_s, expected=RunAck
                    )
                except (BusError, RemoteError) as exc:
                    self.members.unassign(req.request_id, worker_id)
                    reasons.append(f"{worker_id}: {exc}")
                    continue
                if ack.accepted:
                    span.set_attribute("nitsum.worker", worker_id)
                    nodes = {record.stats.node_id} | {
                        r.stats.node_id for w, r in self.members.workers.items() if w == decode_worker
                    }
                    successors = {w for w, r in self.members.workers.items() if r.stats.node_id in nodes} | (
                        {decode_worker} if decode_worker else set()
                    )
                    return SubmitReply(
                        req.request_id,
                        True,
                        worker_id=worker_id,
                        group_id=record.stats.group_id,
                        successors=tuple(sorted(successors - {worker_id})),
                    )
                self.members.unassign(req.request_id, worker_id)
                reasons.append(f"{worker_id}: {ack.reason}")
                if "exceeds the model context" in ack.reason or ack.reason == "empty prompt":
                    return SubmitReply(req.request_id, False, status=400, reason=ack.reason)
            mark_error(span, "; ".join(reasons))
            return SubmitReply(
                req.request_id,
                False,
                status=503,
                retry_after_s=1.0,
                reason="no worker accepted the request: " + "; ".join(reasons),
            )

    async def announce_offset(self, req: SubmitRequest, node_id: str) -> None:
        """A re-submitted request carries its streamed tokens as prompt, so an engine counts its output from
        there: every worker of the node learns the offset, so that whichever adopts it in a later TP change
        continues its stream at the right index (the worker it is routed to knows it from the request)."""
        offset = StreamOffset(req.request_id, len(req.output_token_ids))
        for record in self.members.workers.values():
            if record.stats.node_id == node_id:
                try:
                    await self.bus.publish(self.bus.subjects.worker_control(record.worker_id), offset)
                except Exception as exc:  # NATS down: the request itself cannot be routed either
                    log.warning("could not tell %s the stream offset of %s: %s", record.worker_id, req.request_id, exc)

    async def on_stats(self, stats: WorkerStats, _delivery) -> None:
        for worker_id, request_ids in self.members.on_stats(stats, time.monotonic()):
            await self.announce_lost(worker_id, request_ids, "worker restarted")

    async def announce_lost(self, worker_id: str, request_ids: tuple[str, ...], reason: str) -> None:
        log.warning("worker %s lost (%s); %d request(s) to re-route", worker_id, reason, len(request_ids))
        # A transition of its node waits for no more acks: its peers' collectives cannot complete.
        self.transitions.worker_lost(worker_id, reason)
        try:
            await self.bus.publish(self.bus.subjects.worker_lost, WorkerLost(worker_id, request_ids, reason))
        except Exception as exc:  # NATS down: gateways fall back to their stream timeout
            log.warning("could not announce the loss of %s: %s", worker_id, exc)

    # ---- background loops ------------------------------------------------------------------------
    async def watch(self) -> None:
        """Expire silent workers (announcing their requests for re-routing) and refresh gauges."""
        await self.liveness.run()

    async def epochs(self) -> None:
        """Every policy epoch: topology decisions and shedding."""
        period_s = self.config.reconfig_interval_ms / 1000.0
        last_s = -math.inf  # when the last epoch began (time.monotonic)
        while not self.ctx.stop.is_set():
            # An epoch ends when its period is over, or early on a queue event (see on_submit) -- or at stop (a
            # long NITSUM_RECONFIG_INTERVAL_MS must not hold the service's shutdown).
            waits = {asyncio.ensure_future(self.trigger.wait()), asyncio.ensure_future(self.ctx.stop.wait())}
            await asyncio.wait(waits, timeout=period_s, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            since_s = time.monotonic() - last_s
            if self.trigger.is_set() and since_s < EVENT_EPOCH_GAP_S and not self.ctx.stop.is_set():
                # A queue event comes with nearly every interactive submission under load: one epoch per
                # EVENT_EPOCH_GAP_S at most, not one per request (they ran back to back at 400 req/s).
                await asyncio.sleep(EVENT_EPOCH_GAP_S - since_s)
            self.trigger.clear()
            if self.ctx.stop.is_set():
                break
            if not self.members.workers:
                continue
            last_s = time.monotonic()
            try:
                await self.run_epoch()
            except Exception as exc:  # noqa: BLE001 -- one bad epoch (a policy's bug) must not end every later one
                problem = f"{type(exc).__name__}: {exc}"
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                where = f"{type(exc).__name__} at {frame.filename}:{frame.lineno}"  # not the text: it may vary
                if where != self.epoch_problem:  # once per distinct problem, not every epoch
                    log.exception("policy %s: epoch failed (the next epoch tries again): %s", self.policy_spec, problem)
                self.epoch_problem = where
                self.last_decisions = [
                    {
                        "node_id": None,
                        "target": None,
                        "reason": f"epoch failed: {problem}",
                        "path": "error",
                        "score_gain": 0.0,
                    }
                ]
            else:
                self.epoch_problem = ""

    async def run_epoch(self) -> None:
        """One policy epoch: topology decisions, then shedding."""
        snap = self.snapshot()
        t0 = time.perf_counter()
        decisions = self.policy.decide_topology(snap)
        decide_ms = (time.perf_counter() - t0) * 1000.0
        self.ctx.metrics.reconfiguration_duration_ms().labels(phase="decide").observe(decide_ms)
        self.last_decisions = [
            {
                "node_id": d.node_id,
                "target": str(d.target) if d.target is not None else None,
                "reason": d.reason,
                "path": d.path,
                "score_gain": d.score_gain,
            }
            for d in decisions
        ]
        self.warn_unfit_layouts()
        for d in decisions:
            if d.target is None or self.transitions.lock.locked() or d.node_id in self.pinned_nodes:
                continue
            try:
                self.transitions.check(d.node_id, d.target)
            except TransitionError as exc:
                log.debug("policy %s wants %s on %s but: %s", self.policy_spec, d.target, d.node_id, exc)
                continue
            task = asyncio.create_task(
                self.transitions.apply(d.node_id, d.target, f"policy {self.policy_spec}: {d.reason}", decide_ms)
            )
            task.add_done_callback(_log_failure)
        # Only work not yet prefilled (as heard: the workers refuse to shed a request already streaming) is shed;
        # a request whose tokens flow is never killed (they are paid for, and the client is reading them).
        waiting = {r.request_id for r in snap.requests if r.first_token_ms is None}
        self.shed_asked &= waiting  # asked once: a worker that refused (already streaming) is not asked again
        for request_id in self.members.sheddable([r for r in self.policy.shed(snap) if r in waiting], self.shed_asked):
            self.shed_asked.add(request_id)
            log.warning("shedding %s: it cannot meet its SLO", request_id)
            try:
                await self.bus.publish(self.bus.subjects.abort, AbortRequest(request_id, "shed"))
            except Exception as exc:
                log.warning("could not shed %s: %s", request_id, exc)

    def warn_unfit_layouts(self) -> None:
        """Once per node and policy: the policy's layout cannot be built on a node even at its full size (a
        NITSUM_POLICY the coordinator started with, which set-policy would have refused)."""
        for node in self.full_nodes():
            key = (node.node_id, self.policy_spec)
            if key in self.unfit_warned:
                continue
            try:
                self.policy.initial_topology(node)
            except Exception as exc:  # noqa: BLE001 -- a warning, never the epoch's failure
                self.unfit_warned.add(key)
                log.warning(
                    "policy %s cannot lay out node %s (%d devices): %s; its topology stays as it is",
                    self.policy_spec,
                    node.node_id,
                    node.num_devices,
                    exc,
                )

    def update_metrics(self) -> None:
        depth = self.members.outstanding_by_tier()
        gauge = self.ctx.metrics.queue_depth()
        for tier in ("interactive", "background"):
            gauge.labels(tier=tier).set(depth.get(tier, 0))
        tp = self.ctx.metrics.current_tp_level()
        for worker_id, record in self.members.workers.items():
            tp.labels(worker=worker_id).set(record.stats.tp)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("transition failed: %s", task.exception())
