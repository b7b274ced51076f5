"""The transition agent: carries a node from its current topology to a target one (ALGORITHMS.md §1.4).

Prepare(epoch, plan) goes to every current group leader of the node at once (they rendezvous in the
node world's collectives); if every leader acks, Commit(epoch) follows, else Abort(epoch) and the old
topology keeps serving. Epochs only grow (above every epoch a worker reports, so a restarted coordinator
never reuses one). Each phase is timed into `nitsum_reconfiguration_duration_ms{phase}` and a span.

A worker of the node that dies mid-transition leaves its peers in a collective that fails ("connection
closed") or times out. The agent does not wait for every ack then: the loss of a worker of the node
(membership: heartbeat timeout or restart, `worker_lost`) ends the phase at once and Abort goes to the
surviving leaders (so does a phase whose acks all came back with a failure, as before); the report says `aborted` and whom the node lost, and the abort acks
are added to the history entry as they come (survivors answer once their own collectives have failed).
The requests of a lost worker are announced by the coordinator as for any loss (the gateways re-submit
them); survivors whose group lost a member fall back to TP=1 and re-queue theirs (services/worker/peer_loss.py).
Once the lost worker is back (restarted in standby), the node's world is re-formed (reform.py) and TP
changes are possible again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nitsum.bus import BusError
from nitsum.telemetry.tracing import mark_error
from nitsum.topology import ROLES, Group, Topology
from nitsum.wire.messages import GroupAssignment, TopologyAbort, TopologyAck, TopologyCommit, TopologyPrepare
from nitsum.wire.node import group_id_of

log = logging.getLogger("nitsum.coordinator.transition")

PREPARE_TIMEOUT_S = 90.0
COMMIT_TIMEOUT_S = 90.0
# Abort acks are awaited in the background: a survivor answers only once its failed collective returned.
ABORT_TIMEOUT_S = 90.0


def roles_of(topology: Topology) -> tuple[str, ...]:
    return tuple(g.role for g in topology.groups)


class TransitionError(Exception):
    """The change was refused before anything started (bad target, node not able to change)."""


class Watch:
    """The workers of the node under transition; set when one of them is lost."""

    def __init__(self, worker_ids) -> None:
        self.worker_ids = set(worker_ids)
        self.lost: list[tuple[str, str]] = []  # (worker id, why)
        self.event = asyncio.Event()


class TransitionAgent:
    def __init__(self, coordinator) -> None:
        self.c = coordinator
        self.lock = asyncio.Lock()
        self.epoch = 0
        self.history: list[dict] = []
        self.active_watch: Watch | None = None
        self._abort_tasks: set[asyncio.Task] = set()

    def worker_lost(self, worker_id: str, reason: str) -> None:
        """Membership lost a worker: a transition of its node stops waiting for acks."""
        watch = self.active_watch
        if watch is not None and worker_id in watch.worker_ids and worker_id not in [w for w, _ in watch.lost]:
            watch.lost.append((worker_id, reason))
            watch.event.set()

    def node_records(self, node_id: str):
        return sorted(
            (r for r in self.c.members.workers.values() if r.stats.node_id == node_id),
            key=lambda r: r.stats.device_index,
        )

    def current(self, node_id: str) -> Topology:
        groups = {}
        for r in self.node_records(node_id):
            s = r.stats
            start = s.device_index - s.device_index % s.tp
            if start not in groups or s.leader:  # the leader reports its group's role
                groups[start] = Group(start, s.tp, s.role if s.role in ROLES else "hybrid")
        return Topology(tuple(groups[k] for k in sorted(groups)))

    def check(self, node_id: str, target: Topology) -> list:
        records = self.node_records(node_id)
        if not records:
            raise TransitionError(f"no worker of node {node_id!r} is known")
        if not all(r.stats.in_world for r in records):
            outside = [r.worker_id for r in records if not r.stats.in_world]
            raise TransitionError(
                f"workers {outside} are not in the node world (standalone or restarted): TP cannot change on {node_id} "
                "until its world is re-formed (automatic once every worker of the node is back at TP=1; "
                "`nitsum admin reform-node` asks now)"
            )
        devices = [r.stats.device_index for r in records]
        if devices != list(range(len(records))):
            raise TransitionError(f"node {node_id} is missing workers (have devices {devices})")
        try:
            target.validate(len(records), self.c.config.min_tp, self.c.config.max_tp)
        except (ValueError, AssertionError) as exc:
            raise TransitionError(f"invalid topology {target}: {exc}") from None
        return records

    async def apply(self, node_id: str, target: Topology, reason: str, decide_ms: float = 0.0) -> dict:
        """Run one transition; returns a JSON-able report. Raises TransitionError when refused up front."""
        async with self.lock:
            if self._abort_tasks:
                # Commands reach a worker in order only if the previous abort went out and was answered first.
                await asyncio.wait(set(self._abort_tasks), timeout=ABORT_TIMEOUT_S)
            records = self.check(node_id, target)
            current = self.current(node_id)
            if current.shape() == target.shape() and roles_of(current) == roles_of(target):
                return {"ok": True, "node_id": node_id, "topology": str(target), "changed": False}
            leaders = [r for r in records if r.stats.leader]
            epoch = max([self.epoch] + [r.stats.epoch for r in records]) + 1
            by_device = {r.stats.device_index: r.worker_id for r in records}
            groups = tuple(
                GroupAssignment(
                    group_id_of(node_id, g.start, g.tp),
                    g.start,
                    g.tp,
                    g.role,
                    tuple(by_device[d] for d in range(g.start, g.start + g.tp)),
                )
                for g in target.groups
            )
            metrics = self.c.ctx.metrics.reconfiguration_duration_ms()
            t0 = time.perf_counter()
            self.active_watch = watch = Watch(r.worker_id for r in records)
            try:
                with self.c.ctx.tracer.start_as_current_span(
                    "coordinator.transition",
                    attributes={
                        "nitsum.node": node_id,
                        "nitsum.epoch": epoch,
                        "nitsum.from": str(current),
                        "nitsum.to": str(target),
                        "nitsum.reason": reason,
                    },
                ) as span:
                    acks, stopped = await self.gather(
                        leaders,
                        TopologyPrepare(node_id, epoch, groups, reason),
                        PREPARE_TIMEOUT_S,
                        "prepare",
                        epoch,
                        watch,
                    )
                    prepare_ms = (time.perf_counter() - t0) * 1000.0
                    metrics.labels(phase="prepare").observe(prepare_ms)
                    if stopped:
                        self.epoch = epoch
                        return self._abort(node_id, epoch, "prepare", stopped, leaders, watch, span, t0, current)
                    t1 = time.perf_counter()
                    acks, stopped = await self.gather(
                        leaders, TopologyCommit(node_id, epoch), COMMIT_TIMEOUT_S, "commit", epoch, watch
                    )
                    pause_ms = (time.perf_counter() - t1) * 1000.0
                    total_ms = (time.perf_counter() - t0) * 1000.0 + decide_ms
                    metrics.labels(phase="pause").observe(pause_ms)
                    metrics.labels(phase="total").observe(total_ms)
                    self.epoch = epoch
                    if stopped:
                        # Leaders that committed refuse the abort (stale epoch) and the others drop what they
                        # prepared; survivors whose group lost a member fall back on their own. Until their
                        # heartbeats say otherwise the coordinator keeps its pre-commit view.
                        log.error("commit of epoch %d on %s failed: %s", epoch, node_id, stopped)
                        return self._abort(node_id, epoch, "commit", stopped, leaders, watch, span, t0, current)
            finally:
                self.active_watch = None
            self.c.last_reconfig_ms[node_id] = self.c.now_ms()
            # Until fresh heartbeats arrive, route only to the new leaders.
            for r in records:
                g = next(g for g in target.groups if g.start <= r.stats.device_index < g.start + g.tp)
                r.stats = type(r.stats)(
                    **{
                        **r.stats.__dict__,
                        "tp": g.tp,
                        "group_id": group_id_of(node_id, g.start, g.tp),
                        "leader": r.stats.device_index == g.start,
                        "epoch": epoch,
                        "role": g.role,
                    }
                )
            report = {
                "ok": True,
                "changed": True,
                "node_id": node_id,
                "epoch": epoch,
                "from": str(current),
                "topology": str(target),
                "reason": reason,
                "decide_ms": round(decide_ms, 3),
                "prepare_ms": round(prepare_ms, 3),
                "pause_ms": round(pause_ms, 3),
                "total_ms": round(total_ms, 3),
            }
            log.info(
                "node %s: %s -> %s in %.1f ms (pause %.1f ms): %s", node_id, current, target, total_ms, pause_ms, reason
            )
            self._record(report)
            return report

    def _record(self, report: dict) -> None:
        self.history.append(report)
        del self.history[:-20]

    async def gather(
        self, leaders, message, timeout_s: float, phase: str, epoch: int, watch: Watch
    ) -> tuple[list[TopologyAck], str]:
        """Every leader's ack, or fewer when a worker of the node is lost meanwhile: its peers may sit in a
        collective that cannot complete, so waiting on would only wait out their timeouts. A failed ack does
        not end the phase early: the other span members are still in (or about to enter) the exchange, which
        every member joins even when it refuses, and an Abort sent now would queue behind it anyway.
        Returns (acks, why the phase failed or "")."""
        bus = self.c.bus

        async def one(record) -> TopologyAck:
            try:
                return await bus.request(
                    bus.subjects.worker_control(record.worker_id), message, timeout_s, expected=TopologyAck
                )
            except BusError as exc:
                return TopologyAck(record.worker_id, epoch, False, phase, f"{type(exc).__name__}: {exc}")

        pending = {asyncio.create_task(one(r)) for r in leaders}
        lost = asyncio.create_task(watch.event.wait())
        acks: list[TopologyAck] = []
        try:
            while pending:
                done, pending = await asyncio.wait(pending | {lost}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(lost)
                acks.extend(t.result() for t in done if t is not lost)
                if watch.lost:
                    failed = "".join(f"; {a.worker_id}: {a.reason}" for a in acks if not a.ok)
                    return acks, "; ".join(f"worker {w} lost ({why})" for w, why in watch.lost) + failed
        finally:
            # Late acks of a stopped phase have no reader (the worker's reply goes nowhere).
            for task in pending | {lost}:
                task.cancel()
        return acks, "; ".join(f"{a.worker_id}: {a.reason}" for a in acks if not a.ok)

    def _abort(
        self, node_id: str, epoch: int, phase: str, why: str, leaders, watch: Watch, span, t0: float, current: Topology
    ) -> dict:
        """Record the failed transition and send Abort to the leaders still alive. The report goes back now;
        the abort acks join its history entry when the survivors answer."""
        lost = [w for w, _ in watch.lost]
        survivors = [r for r in leaders if r.worker_id not in lost]
        abort_ms = (time.perf_counter() - t0) * 1000.0
        self.c.ctx.metrics.reconfiguration_duration_ms().labels(phase="abort").observe(abort_ms)
        mark_error(span, f"{phase} aborted: {why}")
        report = {
            "ok": False,
            "aborted": True,
            "node_id": node_id,
            "epoch": epoch,
            "phase": phase,
            "error": why,
            "lost_workers": lost,
            "topology": str(current),
            "abort_ms": round(abort_ms, 3),
            "abort_sent_to": [r.worker_id for r in survivors],
            "abort_acks": None,
        }
        log.warning("node %s: epoch %d aborted in %s after %.1f ms: %s", node_id, epoch, phase, abort_ms, why)
        self._record(report)

        async def send() -> None:
            acks, _ = await self.gather(
                survivors, TopologyAbort(node_id, epoch, why), ABORT_TIMEOUT_S, "abort", epoch, Watch(())
            )
            report["abort_acks"] = [{"worker_id": a.worker_id, "ok": a.ok, "reason": a.reason} for a in acks]
            log.info("node %s: abort of epoch %d answered: %s", node_id, epoch, report["abort_acks"])

        task = asyncio.create_task(send())
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)
        return report
