"""The flow-scheduler's view of the prefill workers' queues: the requests they admitted for a hand-off and have
not finished prefilling (PrefillAdmission), the input of the overload check on batch arrival (paper §4.4.2,
docs/SIMULATOR.md rule 33). `FlowService` runs the check and tells the workers; this keeps the state.

A report is advice: a pending request not heard of for PENDING_MAX_S, or PENDING_PAST_DEADLINE_S past its
deadline (a live one is pruned long before), is forgotten (its `left` report was lost), and so is everything an
earlier process of a restarted worker admitted.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass

from nitsum.wire.messages import PrefillAdmission

log = logging.getLogger("nitsum.flow_scheduler")

MEMORY = 10_000  # request ids remembered as left, or as pruned before any flow
PENDING_MAX_S = 300.0  # a pending request older than this is forgotten (its "left" report was lost)
PENDING_PAST_DEADLINE_S = 30.0  # ... and one this long past its deadline (it would have been pruned by then)


@dataclass(frozen=True)
class Pending:
    """A request admitted at a prefill worker that has not finished its prefill."""

    worker_id: str
    deadline_ms: float
    compute_ms: float
    since_ms: float
    turn_ms: float = 0.0


def _remember(ids: OrderedDict[str, None], rid: str) -> None:
    ids[rid] = None
    while len(ids) > MEMORY:
        ids.popitem(last=False)


def compute_left(queue: list[tuple[str, Pending]], now: float) -> dict[str, float]:
    """What is left of each pending request's compute at `now`, on a virtual first-come-first-served schedule of
    the worker's estimates: each starts at its admission or when the one before it ends, whichever is later."""
    left: dict[str, float] = {}
    cursor = -math.inf
    for rid, p in sorted(queue, key=lambda q: (q[1].since_ms, q[0])):
        start = max(cursor, p.since_ms)
        left[rid] = p.compute_ms - min(max(now - start, 0.0), p.compute_ms)
        cursor = start + p.compute_ms
    return left


class PrefillQueues:
    def __init__(self) -> None:
        self.pending: dict[str, Pending] = {}  # request id -> its admission report (prefill not over)
        self.left: OrderedDict[str, None] = OrderedDict()
        self.worker_instance: dict[str, str] = {}  # worker id -> the process instance its last report came from
        self.pruned: OrderedDict[str, None] = OrderedDict()  # pruned while pending, before any flow

    def report(self, msg: PrefillAdmission, now: float) -> tuple[list[str], bool] | None:
        """Take a report in: (requests to take the prune of back, whether any request was admitted), or None
        for a malformed one (logged; nothing changes). A request pruned while pending that is reported left
        goes on after all: its worker kept it (the prune came after its first token), or dropped it and
        nothing of it comes any more. A re-admitted one is a re-submission placed anew."""
        n = len(msg.request_ids)
        if len(msg.ttft_deadlines_unix_ms) != n or len(msg.compute_ms) != n or not msg.worker_id:
            log.warning(
                "prefill admission report from %r ignored: %d request ids, %d deadlines, %d compute estimates",
                msg.worker_id,
                n,
                len(msg.ttft_deadlines_unix_ms),
                len(msg.compute_ms),
            )
            return None
        unprune: list[str] = []
        for rid in msg.left:
            self.pending.pop(rid, None)
            _remember(self.left, rid)
            if self.pruned.pop(rid, "no") is None:
                unprune.append(rid)
        if msg.instance and self.worker_instance.get(msg.worker_id, msg.instance) != msg.instance:
            # the worker restarted under the same id: what its earlier process admitted is gone with it
            for rid in [r for r, p in self.pending.items() if p.worker_id == msg.worker_id]:
                del self.pending[rid]
        if msg.instance:
            self.worker_instance[msg.worker_id] = msg.instance
        admitted = False
        turn = float(msg.turn_ms) if msg.turn_ms >= 0.0 else 0.0
        for rid, deadline, compute in zip(msg.request_ids, msg.ttft_deadlines_unix_ms, msg.compute_ms):
            if rid in self.left or not compute >= 0.0:
                continue
            unprune.append(rid)
            self.pending[rid] = Pending(msg.worker_id, float(deadline), float(compute), now, turn)
            admitted = True
        return unprune, admitted

    def prefilled(self, rid: str) -> None:
        """Its hand-off began: its prefill is over."""
        self.pending.pop(rid, None)

    def pruned_now(self, rid: str) -> Pending | None:
        """The check pruned `rid`; its admission report if it was pending (its worker is to be told)."""
        admitted = self.pending.pop(rid, None)
        if admitted is not None:
            _remember(self.pruned, rid)
        return admitted

    def walk_inputs(
        self, worker_id: str, now: float, flow_ms: dict[str, float], skip: list[str]
    ) -> tuple[dict[str, float], dict[str, tuple[str, float]]]:
        """The check's inputs for `worker_id`'s queue (stale reports of any worker forgotten first): each request's
        delay (what is left of its compute, plus its flows' transfer time) and its (unit, deadline), every deadline
        the turn's fixed cost earlier (counted once, ahead of all of them; σ is unchanged)."""
        for rid in [
            r
            for r, p in self.pending.items()
            if now - p.since_ms > PENDING_MAX_S * 1000.0 or now - p.deadline_ms > PENDING_PAST_DEADLINE_S * 1000.0
        ]:
            del self.pending[rid]
        queue = [(rid, p) for rid, p in self.pending.items() if p.worker_id == worker_id and rid not in skip]
        if not queue:
            return {}, {}
        est = {rid: left + flow_ms.get(rid, 0.0) for rid, left in compute_left(queue, now).items()}
        turn = max(p.turn_ms for _, p in queue)
        return est, {rid: (rid, p.deadline_ms - turn) for rid, p in queue}  # a live unit is one request
