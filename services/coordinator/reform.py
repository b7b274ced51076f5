"""Re-formation: a node whose world lost a member gets a new one, without restarting the mesh.

A process world cannot take a member back: after a worker of a node dies, its survivors serve outside the
world (services/worker/peer_loss.py) and its restarted process boots in standby (NITSUM_NODE_STANDBY: a
TP=1 engine on the node's boot weights). TP changes on the node stop (`TransitionAgent.check` wants every
worker in the world). This agent heals it: once every device 0..n-1 of the node reports (`node_size` from
the heartbeats) and is ready, some are outside the world, no transition runs and every worker is at TP=1,
it sends `NodeReform(node_id, generation, n)` to all of them at once (generation = the largest one any worker
reports or this agent tried, plus one). Each worker builds the new world in the background (the rendezvous
waits for every member, bounded by the workers' NITSUM_WORLD_TIMEOUT_S) and swaps it in at a step boundary,
keeping its engine and requests. The acks are gathered with a timeout (never hangs); a failure is logged,
recorded and retried later with the next generation. Automatic (`run`, every RETRY_PERIOD_S) and by hand
(`nitsum admin reform-node`). Every attempt is a `coordinator.reform` span, a log line and a history entry
(admin `status`, "reforms").

A TP>1 group that survived the loss whole keeps serving but refuses transitions; it blocks the re-formation
(only TP=1 workers join a new world) and the answer says so.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nitsum.bus import BusError
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import NodeReform, TopologyAck

log = logging.getLogger("nitsum.coordinator.reform")

# A worker answers once its rendezvous (<= its world timeout) and the runtime's exchange (<= the same) are
# done; this only bounds a worker that never answers.
REFORM_TIMEOUT_S = 150.0
CHECK_PERIOD_S = 1.0
RETRY_AFTER_S = 10.0
SETTLE_S = 3.0
HISTORY = 20


class ReformError(Exception):
    """The node cannot be re-formed now (why is the message)."""


class ReformAgent:
    def __init__(self, coordinator) -> None:
        self.c = coordinator
        self.generation = 0  # the largest generation this agent asked for
        self.history: list[dict] = []
        self._retry_at: dict[str, float] = {}  # node -> monotonic time of the next automatic attempt

    def nodes(self) -> list[str]:
        return sorted({r.stats.node_id for r in self.c.members.workers.values() if r.stats.node_size > 1})

    def needed(self, node_id: str) -> bool:
        """Some worker of this node-world node is outside the world."""
        records = self.c.transitions.node_records(node_id)
        return any(r.stats.node_size > 1 for r in records) and not all(r.stats.in_world for r in records)

    def check(self, node_id: str, holding_lock: bool = False) -> list:
        """The node's workers by device, or ReformError with why it cannot be re-formed now."""
        records = self.c.transitions.node_records(node_id)
        if not records:
            raise ReformError(f"no worker of node {node_id!r} is known")
        sizes = {r.stats.node_size for r in records}
        if sizes == {0}:
            raise ReformError(f"the workers of node {node_id!r} are standalone (NITSUM_NODE_SIZE=0): there is no node world to re-form")
        if len(sizes) != 1:
            raise ReformError(f"the workers of node {node_id!r} disagree on the node's size ({sorted(sizes)})")
        size = sizes.pop()
        devices = [r.stats.device_index for r in records]
        if devices != list(range(size)):
            raise ReformError(f"node {node_id} is missing workers: have devices {devices}, its world needs 0..{size - 1}")
        not_ready = [r.worker_id for r in records if r.stats.state != "ready"]
        if not_ready:
            raise ReformError(f"workers {not_ready} of node {node_id} are not ready")
        if all(r.stats.in_world for r in records):
            generation = max(r.stats.generation for r in records)
            raise ReformError(f"every worker of node {node_id} is in its world (generation {generation}): nothing to re-form")
        wide = sorted({(r.stats.group_id, r.stats.tp) for r in records if r.stats.tp > 1})
        if wide:
            groups = ", ".join(f"{g} (TP={tp})" for g, tp in wide)
            raise ReformError(f"group(s) {groups} survived the loss whole and keep serving, but refuse TP changes; only "
                              f"TP=1 workers join a re-formed world, so node {node_id} is re-formed once they are at TP=1")
        if not holding_lock and self.c.transitions.lock.locked():
            raise ReformError("a transition or re-formation is running on the mesh; try again when it is done")
        return records

    async def run(self, stop: asyncio.Event) -> None:
        """Re-form every node that needs it, as soon as it can be; a failed attempt waits RETRY_AFTER_S."""
        while not stop.is_set():
            for node_id in self.nodes():
                if not self.needed(node_id) or time.monotonic() < self._retry_at.get(node_id, 0.0):
                    continue
                try:
                    report = await self.reform(node_id, "automatic: a worker of the node is outside its world")
                except ReformError as exc:
                    log.debug("node %s not re-formed yet: %s", node_id, exc)
                    continue
                if not report["ok"]:
                    self._retry_at[node_id] = time.monotonic() + RETRY_AFTER_S
            try:
                await asyncio.wait_for(stop.wait(), timeout=CHECK_PERIOD_S)
            except asyncio.TimeoutError:
                pass

    async def reform(self, node_id: str, reason: str) -> dict:
        """One attempt; returns a JSON-able report. Raises ReformError when refused up front."""
        self.check(node_id)  # refuse at once rather than wait for the lock
        async with self.c.transitions.lock:
            records = self.check(node_id, holding_lock=True)  # things may have changed while waiting for it
            size = len(records)
            generation = max([self.generation] + [r.stats.generation for r in records]) + 1
            self.generation = generation
            outside = [r.worker_id for r in records if not r.stats.in_world]
            t0 = time.perf_counter()
            with self.c.ctx.tracer.start_as_current_span(
                "coordinator.reform", attributes={"nitsum.node": node_id, "nitsum.generation": generation, "nitsum.reason": reason}
            ) as span:
                log.info("node %s: re-forming its world as generation %d (%d workers; outside it: %s): %s", node_id, generation, size, outside, reason)
                acks = await asyncio.gather(*(self._ask(r.worker_id, NodeReform(node_id, generation, size)) for r in records))
                ms = (time.perf_counter() - t0) * 1000.0
                failed = [a for a in acks if not a.ok]
                report = {
                    "ok": not failed, "node_id": node_id, "generation": generation, "workers": [r.worker_id for r in records],
                    "outside": outside, "reason": reason, "ms": round(ms, 3),
                    "acks": [{"worker_id": a.worker_id, "ok": a.ok, "reason": a.reason} for a in acks],
                }
                if failed:
                    report["error"] = "; ".join(f"{a.worker_id}: {a.reason}" for a in failed)
                    mark_error(span, report["error"])
                    log.error("node %s: re-formation as generation %d failed after %.0f ms: %s", node_id, generation, ms, report["error"])
                else:
                    span.set_attribute("nitsum.ok", True)
                    # Until fresh heartbeats arrive: every worker is in the new world, at TP=1.
                    for r in records:
                        r.stats = type(r.stats)(**{**r.stats.__dict__, "in_world": True, "generation": generation})
                    # Heartbeats sent before the swap may still arrive: do not read them as a new need at once.
                    self._retry_at[node_id] = time.monotonic() + SETTLE_S
                    log.info("node %s: world generation %d formed in %.0f ms; TP changes are on again", node_id, generation, ms)
            self.history.append(report)
            del self.history[:-HISTORY]
            return report

    async def _ask(self, worker_id: str, message: NodeReform) -> TopologyAck:
        bus = self.c.bus
        try:
            return await bus.request(bus.subjects.worker_control(worker_id), message, REFORM_TIMEOUT_S, expected=TopologyAck)
        except BusError as exc:
            return TopologyAck(worker_id, message.generation, False, "reform", f"no answer: {type(exc).__name__}: {exc}")
