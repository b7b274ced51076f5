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
recorded and retried later with the next generation. Automatic (`run`, looking every CHECK_PERIOD_S) and by hand
(`nitsum admin reform-node`). Every attempt is a `coordinator.reform` span, a log line and a history entry
(admin `status`, "reforms").

Only TP=1 workers join a new world. A TP>1 group whose members all still answer is split to TP=1 first, by
a transition sent to its leader alone: its span is the group itself, so only the group's own communicator is
used (the workers outside it learn nothing, and need not: every worker gets a fresh all-TP=1 topology in the
new world right after). That holds both for a group the loss never touched and for one that kept serving after
the failed transition that lost the member (its leader takes a split of itself, `PeerLossGuard.local_change`).
The re-formation waits (`check`) while a worker has not reported just now (one that just died is listed until
its heartbeat times out) and while the members of a group disagree on it (one is dying or falling back).
"""

from __future__ import annotations

import asyncio
import logging
import time

from nitsum.bus import BusError
from nitsum.telemetry.tracing import mark_error
from nitsum.topology import Group, Topology
from nitsum.wire.messages import (
    GroupAssignment,
    NodeReform,
    TopologyAbort,
    TopologyAck,
    TopologyCommit,
    TopologyPrepare,
)
from nitsum.wire.node import group_id_of
from nitsum_services.coordinator.transition import Watch

log = logging.getLogger("nitsum.coordinator.reform")

# A worker answers once its rendezvous (<= its world timeout) and the runtime's exchange (<= the same) are
# done; this only bounds a worker that never answers.
REFORM_TIMEOUT_S = 150.0
CHECK_PERIOD_S = 1.0
RETRY_AFTER_S = 10.0  # after a failed attempt; doubled after each further one, up to MAX_RETRY_AFTER_S
MAX_RETRY_AFTER_S = 160.0
SETTLE_S = 3.0
FRESH_S = 1.5  # every worker's last heartbeat is at most this old (they beat every 0.5 s by default)
SPLIT_TIMEOUT_S = 90.0
SPLIT_SETTLE_S = 15.0  # for the split group's heartbeats to show TP=1
HISTORY = 20


class ReformError(Exception):
    """The node cannot be re-formed now (why is the message)."""


class ReformAgent:
    def __init__(self, coordinator) -> None:
        self.c = coordinator
        self.generation = 0  # the largest generation this agent asked for
        self.history: list[dict] = []
        self._retry_at: dict[str, float] = {}  # node -> monotonic time of the next automatic attempt
        self._failures: dict[str, int] = {}  # node -> automatic attempts failed in a row

    def nodes(self) -> list[str]:
        return sorted({r.stats.node_id for r in self.c.members.workers.values() if r.stats.node_size > 1})

    def needed(self, node_id: str) -> bool:
        """Some worker of this node-world node is outside the world."""
        records = self.c.transitions.node_records(node_id)
        return any(r.stats.node_size > 1 for r in records) and not all(r.stats.in_world for r in records)

    def check(self, node_id: str, holding_lock: bool = False, now_s: float | None = None) -> list:
        """The node's workers by device, or ReformError with why it cannot be re-formed now."""
        now_s = time.monotonic() if now_s is None else now_s
        records = self.c.transitions.node_records(node_id)
        if not records:
            raise ReformError(f"no worker of node {node_id!r} is known")
        sizes = {r.stats.node_size for r in records}
        if sizes == {0}:
            raise ReformError(
                f"the workers of node {node_id!r} are standalone (NITSUM_NODE_SIZE=0): there is no node world to re-form"
            )
        if len(sizes) != 1:
            raise ReformError(f"the workers of node {node_id!r} disagree on the node's size ({sorted(sizes)})")
        size = sizes.pop()
        devices = [r.stats.device_index for r in records]
        if devices != list(range(size)):
            raise ReformError(
                f"node {node_id} is missing workers: have devices {devices}, its world needs 0..{size - 1}"
            )
        # A worker that just died is listed until its heartbeat times out: a world formed with it would wait for
        # it at the rendezvous until the workers' world timeout. Only workers heard from just now take part.
        silent = [r.worker_id for r in records if now_s - r.last_seen_s > FRESH_S]
        if silent:
            raise ReformError(f"workers {silent} of node {node_id} have not reported for over {FRESH_S:g} s")
        not_ready = [r.worker_id for r in records if r.stats.state != "ready"]
        if not_ready:
            raise ReformError(f"workers {not_ready} of node {node_id} are not ready")
        if all(r.stats.in_world for r in records):
            generation = max(r.stats.generation for r in records)
            raise ReformError(
                f"every worker of node {node_id} is in its world (generation {generation}): nothing to re-form"
            )
        broken = sorted({(r.stats.group_id, r.stats.tp) for r in records if r.stats.tp > 1 and not r.stats.in_world})
        if broken:
            groups = ", ".join(f"{g} (TP={tp})" for g, tp in broken)
            raise ReformError(
                f"group(s) {groups} of node {node_id} have members outside the world: they cannot be split "
                "to TP=1, and only TP=1 workers join a re-formed world"
            )
        for start, tp in sorted(
            {(r.stats.device_index - r.stats.device_index % r.stats.tp, r.stats.tp) for r in records if r.stats.tp > 1}
        ):
            group_id = group_id_of(node_id, start, tp)
            members = [r for r in records if start <= r.stats.device_index < start + tp]
            if any(r.stats.group_id != group_id for r in members):
                raise ReformError(
                    f"the workers of devices {start}-{start + tp - 1} disagree on their group (one may be gone or "
                    "falling back): waiting for their reports to settle"
                )
        if not holding_lock and self.c.transitions.lock.locked():
            raise ReformError("a transition or re-formation is running on the mesh; try again when it is done")
        return records

    async def run(self, stop: asyncio.Event) -> None:
        """Re-form every node that needs it, as soon as it can be; after a failed attempt the next one waits
        RETRY_AFTER_S, doubled with each further failure (up to MAX_RETRY_AFTER_S)."""
        while not stop.is_set():
            for node_id in self.nodes():
                if not self.needed(node_id) or time.monotonic() < self._retry_at.get(node_id, 0.0):
                    continue
                try:
                    report = await self.reform(node_id, "automatic: a worker of the node is outside its world")
                except ReformError as exc:
                    log.debug("node %s not re-formed yet: %s", node_id, exc)
                    continue
                except Exception:  # a bug must not end the loop: log it, try again later
                    log.exception("re-formation of node %s raised", node_id)
                    self._retry_at[node_id] = time.monotonic() + MAX_RETRY_AFTER_S
                    continue
                if not report["ok"]:
                    failures = self._failures[node_id] = self._failures.get(node_id, 0) + 1
                    self._retry_at[node_id] = time.monotonic() + min(
                        MAX_RETRY_AFTER_S, RETRY_AFTER_S * 2 ** (failures - 1)
                    )
                else:
                    self._failures.pop(node_id, None)
            try:
                await asyncio.wait_for(stop.wait(), timeout=CHECK_PERIOD_S)
            except TimeoutError:
                pass

    async def reform(self, node_id: str, reason: str) -> dict:
        """One attempt; returns a JSON-able report. Raises ReformError when refused up front."""
        self.check(node_id)  # refuse at once rather than wait for the lock
        async with self.c.transitions.lock:
            records = self.check(node_id, holding_lock=True)  # things may have changed while waiting for it
            t0 = time.perf_counter()
            with self.c.ctx.tracer.start_as_current_span(
                "coordinator.reform", attributes={"nitsum.node": node_id, "nitsum.reason": reason}
            ) as span:
                splits, problem = await self._split_wide_groups(node_id, records)
                if problem:
                    report = {
                        "ok": False,
                        "node_id": node_id,
                        "generation": None,
                        "workers": [r.worker_id for r in records],
                        "reason": reason,
                        "splits": splits,
                        "error": problem,
                        "ms": round((time.perf_counter() - t0) * 1000.0, 3),
                    }
                    mark_error(span, problem)
                    log.error("node %s: not re-formed: %s", node_id, problem)
                    self._record(report)
                    return report
                if splits:
                    records = self.check(node_id, holding_lock=True)  # every worker reports TP=1 now
                size = len(records)
                generation = max([self.generation] + [r.stats.generation for r in records]) + 1
                self.generation = generation
                span.set_attribute("nitsum.generation", generation)
                outside = [r.worker_id for r in records if not r.stats.in_world]
                log.info(
                    "node %s: re-forming its world as generation %d (%d workers; outside it: %s): %s",
                    node_id,
                    generation,
                    size,
                    outside,
                    reason,
                )
                acks = await asyncio.gather(
                    *(self._ask(r.worker_id, NodeReform(node_id, generation, size)) for r in records)
                )
                ms = (time.perf_counter() - t0) * 1000.0
                failed = [a for a in acks if not a.ok]
                report = {
                    "ok": not failed,
                    "node_id": node_id,
                    "generation": generation,
                    "workers": [r.worker_id for r in records],
                    "outside": outside,
                    "reason": reason,
                    "ms": round(ms, 3),
                    "splits": splits,
                    "acks": [{"worker_id": a.worker_id, "ok": a.ok, "reason": a.reason} for a in acks],
                }
                if failed:
                    report["error"] = "; ".join(f"{a.worker_id}: {a.reason}" for a in failed)
                    mark_error(span, report["error"])
                    log.error(
                        "node %s: re-formation as generation %d failed after %.0f ms: %s",
                        node_id,
                        generation,
                        ms,
                        report["error"],
                    )
                else:
                    span.set_attribute("nitsum.ok", True)
                    # Until fresh heartbeats arrive: every worker is in the new world, at TP=1.
                    for r in records:
                        r.stats = type(r.stats)(**{**r.stats.__dict__, "in_world": True, "generation": generation})
                    # Heartbeats sent before the swap may still arrive: do not read them as a new need at once.
                    self._retry_at[node_id] = time.monotonic() + SETTLE_S
                    log.info(
                        "node %s: world generation %d formed in %.0f ms; TP changes are on again",
                        node_id,
                        generation,
                        ms,
                    )
            self._record(report)
            return report

    def _record(self, report: dict) -> None:
        self.history.append(report)
        del self.history[:-HISTORY]

    async def _split_wide_groups(self, node_id: str, records: list) -> tuple[list[dict], str]:
        """Split every TP>1 group of the node (all its members in the world) to TP=1 workers, one group at a
        time, by a transition sent to that group's leader only. Returns (one entry per group, why it failed
        or "")."""
        transitions = self.c.transitions
        splits: list[dict] = []
        by_device = {r.stats.device_index: r.worker_id for r in records}
        wide = sorted(
            {(r.stats.device_index - r.stats.device_index % r.stats.tp, r.stats.tp) for r in records if r.stats.tp > 1}
        )
        for start, tp in wide:
            group_id = group_id_of(node_id, start, tp)
            current = transitions.current(node_id)
            singles = tuple(Group(d, 1, "hybrid") for d in range(start, start + tp))
            target = Topology(tuple(g for g in current.groups if g.start != start) + singles)
            members = [r for r in records if start <= r.stats.device_index < start + tp]
            leader = [r for r in members if r.stats.device_index == start]
            epoch = max([transitions.epoch] + [r.stats.epoch for r in records]) + 1
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
            t0 = time.perf_counter()
            log.info("node %s: splitting %s to TP=1 (epoch %d) before re-forming its world", node_id, group_id, epoch)
            watch = Watch(r.worker_id for r in members)
            transitions.active_watch = watch  # the loss of a member ends the wait (TransitionAgent.worker_lost)
            try:
                phase = "prepare"
                _acks, why = await transitions.gather(
                    leader,
                    TopologyPrepare(node_id, epoch, groups, "re-formation: split to TP=1"),
                    SPLIT_TIMEOUT_S,
                    phase,
                    epoch,
                    watch,
                )
                if not why:
                    phase = "commit"
                    _acks, why = await transitions.gather(
                        leader, TopologyCommit(node_id, epoch), SPLIT_TIMEOUT_S, phase, epoch, watch
                    )
                if why and not watch.lost:  # whatever the leader prepared goes (a committed leader refuses: stale)
                    await transitions.gather(
                        leader, TopologyAbort(node_id, epoch, why), SPLIT_TIMEOUT_S, "abort", epoch, Watch(())
                    )
            finally:
                transitions.active_watch = None
            transitions.epoch = max(transitions.epoch, epoch)
            splits.append(
                {
                    "group": group_id,
                    "epoch": epoch,
                    "ok": not why,
                    "phase": phase,
                    "error": why,
                    "ms": round((time.perf_counter() - t0) * 1000.0, 3),
                }
            )
            if why:
                return splits, f"group {group_id} (TP={tp}) could not be split to TP=1 in {phase}: {why}"
            # The leader answered the commit; its peers apply it in their step threads and then report: the
            # re-formation (TP=1 workers only) waits for those reports.
            deadline = time.monotonic() + SPLIT_SETTLE_S
            while time.monotonic() < deadline and any(
                r.stats.tp != 1 for r in transitions.node_records(node_id) if start <= r.stats.device_index < start + tp
            ):
                await asyncio.sleep(0.05)
            if any(
                r.stats.tp != 1 for r in transitions.node_records(node_id) if start <= r.stats.device_index < start + tp
            ):
                return splits, f"group {group_id} was split (epoch {epoch}) but its workers do not report TP=1 yet"
        return splits, ""

    async def _ask(self, worker_id: str, message: NodeReform) -> TopologyAck:
        bus = self.c.bus
        try:
            return await bus.request(
                bus.subjects.worker_control(worker_id), message, REFORM_TIMEOUT_S, expected=TopologyAck
            )
        except BusError as exc:
            return TopologyAck(
                worker_id, message.generation, False, "reform", f"no answer: {type(exc).__name__}: {exc}"
            )
