"""P/D hand-offs between the groups of one node world (the worker shell's half of `nitsum.node.handoff`).

Prefill side (`hand_off`, the session's `on_handoff` for a node-world worker): the request pinned after its
first token goes to the decode group the coordinator named (`RunRequest.decode_worker`) or, for a request that
was in the group when it turned prefill, to a decode group of the node (round robin; a hybrid one when there is
none). Offer (the decode leader reserves blocks and answers with its group's arena handles), copy (every
member of the prefill group writes its heads straight into the decode members' caches, at a step boundary of
the prefill group), commit (the decode leader adopts the request and streams it on). The standalone
workers' hand-off (layer by layer over shared memory, transfer.py) is a separate path.

A hand-off that fails anywhere ends the request's stream with the retryable `engine_error`
(kv_transfer_failed): the gateway re-submits it with its first token and the coordinator runs it hybrid. One
that a TP change of the prefill group overtook is given up quietly: the change moved the pinned request into
its new group as a running one (node/transition.py), whose leader streams it on.
Nothing is adopted twice: the decode leader adopts only on the commit, and a reservation whose commit never
comes is dropped after RESERVATION_TTL_S.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack

from nitsum.bus import BusError
from nitsum.node import handoff
from nitsum.node.messages import NodeCommand
from nitsum.wire.messages import NodeHandoffCommit, NodeHandoffOffer, NodeHandoffReady, TopologyAck
from nitsum_services.worker.transfer import _counter

log = logging.getLogger("nitsum.worker.node_handoff")

OFFER_TIMEOUT_S = 10.0
COMMIT_TIMEOUT_S = 10.0
RESERVATION_TTL_S = 30.0  # a reserved request whose commit did not come by then gives its blocks back


class NodeHandoffs:
    def __init__(self, session, bus, worker_id: str, metrics) -> None:
        self.session, self.bus, self.worker_id, self.metrics = session, bus, worker_id, metrics
        # decode side: request -> (its expiry, the epoch it was reserved in)
        self.reserved: dict[str, tuple[asyncio.TimerHandle, int]] = {}
        self.num_sent = 0
        self.num_adopted = 0
        self.num_failed = 0
        self._next = 0

    # -- which decode leaders this node world has -------------------------------------------------------
    def decode_leaders(self) -> list[str]:
        """Leaders of the node's decode groups (hybrid ones when it has none), this worker excluded."""
        runtime = getattr(self.session.backend, "runtime", None)
        if runtime is None:
            return []
        by_role = {"decode": [], "hybrid": []}
        for g in runtime.topology.groups:
            leader = runtime.leaders.get(g.span, "")
            if leader and leader != self.worker_id and g.role in by_role:
                by_role[g.role].append(leader)
        return by_role["decode"] or by_role["hybrid"]

    def reaches(self, worker_id: str) -> bool:
        """`worker_id` leads a group of this node world that decodes (a decode or hybrid one)."""
        runtime = getattr(self.session.backend, "runtime", None)
        if runtime is None or worker_id == self.worker_id:
            return False
        return any(runtime.leaders.get(g.span) == worker_id and g.role != "prefill" for g in runtime.topology.groups)

    def target(self, running) -> str:
        if running.decode_worker:
            return running.decode_worker
        leaders = self.decode_leaders()
        if not leaders:
            return ""
        self._next += 1
        return leaders[self._next % len(leaders)]

    # -- prefill side ---------------------------------------------------------------------------------
    async def hand_off(self, running) -> None:
        """Ship a pinned request to a decode group of the node; never raises."""
        rid, span = running.request_id, running.span
        dst = self.target(running)
        t0 = time.perf_counter()
        reason, reserved, moved = "", False, 0
        try:
            if not dst:
                raise handoff.HandoffError("this node world has no decode group")
            state, num_tokens, blocks = await self.session.call(lambda b: handoff.source(b.runtime, rid))
            ready = await self.bus.request(
                self.bus.subjects.worker_handoff(dst),
                NodeHandoffOffer(rid, self.worker_id, num_tokens),
                OFFER_TIMEOUT_S,
                expected=NodeHandoffReady,
            )
            if not ready.ok:
                raise handoff.HandoffError(f"{dst} refused: {ready.reason}")
            reserved = True
            moved = await self.session.call(lambda b: self._copy(b.runtime, rid, blocks, ready))
            ack = await self.bus.request(
                self.bus.subjects.worker_handoff(dst),
                NodeHandoffCommit(
                    rid,
                    True,
                    msgpack.packb(state, use_bin_type=True),
                    num_tokens,
                    running.prompt_len,
                    running.next_index,
                ),
                COMMIT_TIMEOUT_S,
                expected=TopologyAck,
            )
            reserved = False  # the decode leader adopted it or dropped the reservation itself
            if not ack.ok:
                raise handoff.HandoffError(f"{dst} did not adopt it: {ack.reason}")
        except handoff.NotPinned as exc:
            # A TP change moved it (it decodes on in its new group, whose leader streams it) or it was aborted:
            # nothing is pinned here to release, and nothing to fail.
            if reserved:
                await self._cancel(dst, rid)
            span.add_event("handoff_given_up", {"nitsum.reason": str(exc)})
            log.info("hand-off of %s to %s given up: %s", rid, dst, exc)
            return
        except Exception as exc:  # whatever failed, the request is re-run elsewhere (never a stream left waiting)
            reason = f"{type(exc).__name__}: {exc}"
        self.session.release_pinned(rid)
        self._count("ok" if not reason else "failed")
        if not reason:
            self.num_sent += 1
            span.add_event(
                "handed_off",
                {"nitsum.decode_worker": dst, "nitsum.bytes": moved, "nitsum.ms": (time.perf_counter() - t0) * 1e3},
            )
            self.session.handed_off(rid)
            return
        self.num_failed += 1
        if reserved:
            await self._cancel(dst, rid)
        log.warning("node-world hand-off of %s to %s failed: %s; the request is re-run elsewhere", rid, dst, reason)
        await self.session.fail(rid, "engine_error", f"kv_transfer_failed: hand-off to {dst or '-'}: {reason}")

    def _count(self, outcome: str) -> None:
        _counter(
            self.metrics,
            "kv_transfers",
            "nitsum_kv_transfers_total",
            "KV hand-offs (pd) and prefix fetches (reuse) by outcome",
            ["purpose", "outcome"],
        ).labels(purpose="pd", outcome=outcome).inc()

    @staticmethod
    def _copy(runtime, rid: str, blocks: list[int], ready: NodeHandoffReady) -> int:
        """Step thread: the request's KV into the reserved blocks, if it still sits where it was offered from."""
        _state, _num_tokens, now = handoff.source(runtime, rid)
        if now != blocks:  # pinned here still, in other blocks: cannot be after a change, but never copy stale KV
            raise handoff.HandoffError("the request's KV moved since the offer")
        if runtime.in_transition:  # the prepared change would move the request as well
            raise handoff.HandoffError(f"a TP change of epoch {runtime.prepared_epoch} is in progress here")
        cmd = NodeCommand(
            "handoff",
            runtime.epoch,
            groups=((ready.start, ready.tp),),
            request_id=rid,
            blocks=tuple(blocks),
            dst_blocks=tuple(ready.block_ids),
            handles=tuple(ready.handles),
        )
        moved = handoff.send(runtime, cmd)
        # Its KV is in the decode group now: it leaves this engine at once, so that no later change here can
        # move it too (whatever the commit's answer: a failed hand-off re-runs it from its first token).
        runtime.engine.release(rid)
        return moved

    async def _cancel(self, dst: str, rid: str) -> None:
        try:
            await self.bus.request(
                self.bus.subjects.worker_handoff(dst),
                NodeHandoffCommit(rid, False),
                COMMIT_TIMEOUT_S,
                expected=TopologyAck,
            )
        except BusError as exc:  # its reservation expires on its own
            log.info("cancel of %s's reservation on %s not answered: %s", rid, dst, exc)

    # -- decode side ----------------------------------------------------------------------------------
    async def on_offer(self, msg: NodeHandoffOffer) -> NodeHandoffReady:
        rid = msg.request_id
        if rid in self.reserved or rid in self.session.running:
            return NodeHandoffReady(rid, False, "duplicate request id")
        try:
            blocks, handles = await self.session.call(lambda b: handoff.reserve(b.runtime, rid, msg.num_tokens))
            start, tp = self.session.backend.group
        except (handoff.HandoffError, ValueError, AttributeError, RuntimeError) as exc:
            return NodeHandoffReady(rid, False, f"{type(exc).__name__}: {exc}")
        loop = asyncio.get_running_loop()
        timer = loop.call_later(RESERVATION_TTL_S, lambda: loop.create_task(self._expire(rid)))
        self.reserved[rid] = (timer, self.session.backend.epoch)
        return NodeHandoffReady(rid, True, "", start, tp, blocks, handles)

    async def on_commit(self, msg: NodeHandoffCommit) -> TopologyAck:
        rid = msg.request_id
        refuse = lambda why: TopologyAck(self.worker_id, 0, False, "handoff", why)  # noqa: E731
        reserved = self.reserved.pop(rid, None)
        if reserved is None:
            return refuse(f"no reservation for {rid}")
        timer, epoch = reserved
        timer.cancel()
        if not msg.ok:
            await self._drop(rid)
            return TopologyAck(self.worker_id, 0, True, "handoff", "reservation dropped")
        if self.session.backend.epoch != epoch:
            await self._drop(rid)
            return refuse(f"this group changed since the reservation (epoch {epoch} -> {self.session.backend.epoch})")
        state = msgpack.unpackb(msg.state, raw=False)
        # Registered before the adoption so that the step that follows it finds the stream to publish to.
        self.session.adopt(rid, "", msg.prompt_len, msg.produced)
        try:
            await self.session.call(lambda b: handoff.adopt(b.runtime, state, msg.num_tokens))
        except (handoff.HandoffError, ValueError, AssertionError, KeyError, RuntimeError) as exc:
            self.session.forget(rid)
            await self._drop(rid)
            return refuse(f"{type(exc).__name__}: {exc}")
        self.num_adopted += 1
        return TopologyAck(self.worker_id, 0, True, "handoff")

    async def _expire(self, rid: str) -> None:
        if self.reserved.pop(rid, None) is not None:
            log.warning("reservation of %s expired: its hand-off never committed", rid)
            await self._drop(rid)

    async def _drop(self, rid: str) -> None:
        try:
            await self.session.call(lambda b: handoff.drop(b.runtime, rid))
        except (AttributeError, RuntimeError) as exc:  # the group changed: its pool went with it
            log.info("reservation of %s not dropped: %s", rid, exc)
