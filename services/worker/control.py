"""The worker's `worker.<id>.control` handlers (service.py): a role change, a node world's re-formation
(peer_loss.py), a stream offset to resume from, and Prepare / Commit / Abort of a TP change at its group's
leader. A mixin of `WorkerService`, which owns the state they work on (session, config, migrations,
reforming) and `publish_stats`/`requeue`."""

from __future__ import annotations

import asyncio
import logging
import time

from nitsum.node.messages import NodeCommand
from nitsum.wire.messages import (
    NodeReform,
    RoleChange,
    StreamOffset,
    TopologyAbort,
    TopologyAck,
    TopologyCommit,
    TopologyPrepare,
)
from nitsum_services.worker.backend import NodeBackend
from nitsum_services.worker.boot import die_if_told, join_generation
from nitsum_services.worker.peer_loss import PeerLossGuard, reform_refusal

log = logging.getLogger("nitsum.worker")

CONTROL_TIMEOUT_S = 120.0
MAX_STREAM_OFFSETS = 8192  # re-submitted requests whose stream offset this worker remembers
PHASES = {TopologyPrepare: "prepare", TopologyCommit: "commit", TopologyAbort: "abort"}
ROLES = ("prefill", "decode", "hybrid")


class WorkerControl:
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
