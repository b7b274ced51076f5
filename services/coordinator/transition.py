"""The transition agent: carries a node from its current topology to a target one (ALGORITHMS.md §1.4).

Prepare(epoch, plan) goes to every current group leader of the node at once (they rendezvous in the
node world's collectives); if every leader acks, Commit(epoch) follows, else Abort(epoch) and the old
topology keeps serving. Epochs only grow (above every epoch a worker reports, so a restarted coordinator
never reuses one). Each phase is timed into `nitsum_reconfiguration_duration_ms{phase}` and a span.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nitsum.bus import BusError
from nitsum.policy.decisions import Topology
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import GroupAssignment, TopologyAbort, TopologyAck, TopologyCommit, TopologyPrepare

log = logging.getLogger("nitsum.coordinator.transition")

PREPARE_TIMEOUT_S = 90.0
COMMIT_TIMEOUT_S = 90.0


def group_id_of(node_id: str, start: int, tp: int) -> str:
    return f"{node_id}-g{start}-tp{tp}"


class TransitionError(Exception):
    """The change was refused before anything started (bad target, node not able to change)."""


class TransitionAgent:
    def __init__(self, coordinator) -> None:
        self.c = coordinator
        self.lock = asyncio.Lock()
        self.epoch = 0
        self.history: list[dict] = []

    def node_records(self, node_id: str):
        return sorted((r for r in self.c.members.workers.values() if r.stats.node_id == node_id), key=lambda r: r.stats.device_index)

    def current(self, node_id: str) -> Topology:
        from nitsum.policy.decisions import GroupSpec

        groups = {}
        for r in self.node_records(node_id):
            s = r.stats
            start = s.device_index - s.device_index % s.tp
            groups[start] = GroupSpec(start, s.tp, "hybrid")
        return Topology(tuple(groups[k] for k in sorted(groups)))

    def check(self, node_id: str, target: Topology) -> list:
        records = self.node_records(node_id)
        if not records:
            raise TransitionError(f"no worker of node {node_id!r} is known")
        if not all(r.stats.in_world for r in records):
            outside = [r.worker_id for r in records if not r.stats.in_world]
            raise TransitionError(f"workers {outside} are not in the node world (standalone or restarted): TP cannot change on {node_id}")
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
            records = self.check(node_id, target)
            current = self.current(node_id)
            if current.shape() == target.shape():
                return {"ok": True, "node_id": node_id, "topology": str(target), "changed": False}
            leaders = [r for r in records if r.stats.leader]
            epoch = max([self.epoch] + [r.stats.epoch for r in records]) + 1
            by_device = {r.stats.device_index: r.worker_id for r in records}
            groups = tuple(
                GroupAssignment(group_id_of(node_id, g.start, g.tp), g.start, g.tp, "hybrid", tuple(by_device[d] for d in range(g.start, g.start + g.tp)))
                for g in target.groups
            )
            metrics = self.c.ctx.metrics.reconfiguration_duration_ms()
            t0 = time.perf_counter()
            with self.c.ctx.tracer.start_as_current_span(
                "coordinator.transition", attributes={"nitsum.node": node_id, "nitsum.epoch": epoch, "nitsum.from": str(current), "nitsum.to": str(target), "nitsum.reason": reason}
            ) as span:
                acks = await self._send(leaders, TopologyPrepare(node_id, epoch, groups, reason), PREPARE_TIMEOUT_S, "prepare", epoch)
                prepare_ms = (time.perf_counter() - t0) * 1000.0
                metrics.labels(phase="prepare").observe(prepare_ms)
                failed = [f"{a.worker_id}: {a.reason}" for a in acks if not a.ok]
                if failed:
                    await self._send(leaders, TopologyAbort(node_id, epoch, "; ".join(failed)), PREPARE_TIMEOUT_S, "abort", epoch)
                    mark_error(span, "prepare failed: " + "; ".join(failed))
                    self.epoch = epoch
                    report = {"ok": False, "node_id": node_id, "epoch": epoch, "phase": "prepare", "error": "; ".join(failed), "topology": str(current)}
                    self.history.append(report)
                    return report
                t1 = time.perf_counter()
                acks = await self._send(leaders, TopologyCommit(node_id, epoch), COMMIT_TIMEOUT_S, "commit", epoch)
                pause_ms = (time.perf_counter() - t1) * 1000.0
                total_ms = (time.perf_counter() - t0) * 1000.0 + decide_ms
                metrics.labels(phase="pause").observe(pause_ms)
                metrics.labels(phase="total").observe(total_ms)
                failed = [f"{a.worker_id}: {a.reason}" for a in acks if not a.ok]
                self.epoch = epoch
                if failed:
                    mark_error(span, "commit failed: " + "; ".join(failed))
                    log.error("commit of epoch %d on %s failed: %s", epoch, node_id, failed)
                    report = {"ok": False, "node_id": node_id, "epoch": epoch, "phase": "commit", "error": "; ".join(failed)}
                    self.history.append(report)
                    return report
                self.c.last_reconfig_ms[node_id] = self.c.now_ms()
                # Until fresh heartbeats arrive, route only to the new leaders.
                for r in records:
                    g = next(g for g in target.groups if g.start <= r.stats.device_index < g.start + g.tp)
                    r.stats = type(r.stats)(**{**r.stats.__dict__, "tp": g.tp, "group_id": group_id_of(node_id, g.start, g.tp), "leader": r.stats.device_index == g.start, "epoch": epoch})
                report = {
                    "ok": True, "changed": True, "node_id": node_id, "epoch": epoch, "from": str(current), "topology": str(target), "reason": reason,
                    "decide_ms": round(decide_ms, 3), "prepare_ms": round(prepare_ms, 3), "pause_ms": round(pause_ms, 3), "total_ms": round(total_ms, 3),
                }
                log.info("node %s: %s -> %s in %.1f ms (pause %.1f ms): %s", node_id, current, target, total_ms, pause_ms, reason)
                self.history.append(report)
                del self.history[:-20]
                return report

    async def _send(self, leaders, message, timeout_s: float, phase: str, epoch: int) -> list[TopologyAck]:
        bus = self.c.bus

        async def one(record) -> TopologyAck:
            try:
                return await bus.request(bus.subjects.worker_control(record.worker_id), message, timeout_s, expected=TopologyAck)
            except BusError as exc:
                return TopologyAck(record.worker_id, epoch, False, phase, f"{type(exc).__name__}: {exc}")

        return list(await asyncio.gather(*(one(r) for r in leaders)))
