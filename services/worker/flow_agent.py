"""The worker's transfer agent (the async half of Nuska inside a worker).

`TransferAgent`: asks the flow-scheduler for permits (one FlowSubmitBatch per request), queues flows by
level (`nitsum.transfer.agent.PriorityFlowQueue`: P1 first), takes promotions pushed on
`flow.permit.<worker>`, and reports every flow's completion. The scheduler is advice, never a gate: when it
does not answer in time a flow goes at the lowest level anyway (counted in `nitsum_flow_fallbacks_total`).
A pruned permit (code "overload_pruned", at submit or pushed later) stops the flow before it goes
(`FlowPrunedError`); what that means for a hand-off or a fetch is the KV mover's (`transfer.py`). A FlowPruned
on the same subject is a request pruned before its prefill (it has no flow yet): `on_request_pruned` gets it
(`prefill_admission.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

from nitsum.bus import Bus, BusError
from nitsum.policy.flows import dscp_table
from nitsum.telemetry.metrics import Metrics
from nitsum.transfer.agent import PriorityFlowQueue
from nitsum.transfer.framing import ErrorCode, TransferError
from nitsum.wire.messages import FlowCompletion, FlowPermit, FlowPermitBatch, FlowPruned, FlowSubmit, FlowSubmitBatch

log = logging.getLogger("nitsum.worker.transfer")

PERMIT_TIMEOUT_S = 0.5  # past this a flow goes at the lowest level without its permit
MAX_IN_FLIGHT = 2  # flows this agent sends at once; the rest wait in strict priority order
# A node-world worker's agent carries TP-migration flows only (KV hand-offs need standalone workers); their
# chunks run in the step thread, one round of every running flow per step, so a low limit would only make
# pairs that can move together wait for each other (8 workers: at most 8 x 8 pairs).
NODE_MAX_IN_FLIGHT = 64
NUM_LEVELS = 8
PRUNED_CODE = "overload_pruned"  # FlowPermit.code of a request the flow-scheduler pruned (retry it)


class FlowPrunedError(TransferError):
    """The flow-scheduler pruned this flow's request: nothing more of it is sent."""

    def __init__(self, flow_id: str, reason: str) -> None:
        super().__init__(ErrorCode.PEER, f"pruned by the flow-scheduler: {reason}", flow_id)
        self.reason = reason


def _counter(metrics: Metrics, key: str, name: str, doc: str, labels: list[str]) -> Counter:
    return metrics.get(key, lambda: Counter(name, doc, labels, registry=metrics.registry))


class TransferAgent:
    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        metrics: Metrics,
        num_levels: int = NUM_LEVELS,
        max_in_flight: int = MAX_IN_FLIGHT,
        permit_timeout_s: float = PERMIT_TIMEOUT_S,
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.metrics = metrics
        self.num_levels = num_levels
        self.dscp = dscp_table(num_levels)
        self.max_in_flight = max_in_flight
        self.permit_timeout_s = permit_timeout_s
        self.queue = PriorityFlowQueue()
        self._turn: dict[str, asyncio.Future] = {}
        self.levels: dict[str, int] = {}  # flow id -> current level (waiting or in flight)
        self.in_flight = 0
        self.num_fallbacks = 0
        self.num_promotions = 0
        self.sent_order: list[str] = []  # flow ids in the order they got their turn (tests, tracing)
        self.turn_levels: dict[str, int] = {}  # flow id -> the level it went at (last few; tests, tracing)
        self.num_pruned = 0
        self.on_request_pruned = None  # callback(FlowPruned): a request pruned before it sent any flow

    async def start(self) -> None:
        await self.bus.subscribe(
            self.bus.subjects.flow_permit(self.worker_id), self._on_permit, expected=(FlowPermit, FlowPruned)
        )

    async def permits(self, flows: list[FlowSubmit]) -> list[FlowPermit]:
        """Permits for these flows, in order: the flow-scheduler's, or the lowest level if it is silent."""
        try:
            reply = await self.bus.request(
                self.bus.subjects.flow_submit,
                FlowSubmitBatch(tuple(flows)),
                self.permit_timeout_s,
                expected=FlowPermitBatch,
            )
            by_id = {p.flow_id: p for p in reply.permits}
            if all(f.flow_id in by_id for f in flows):
                return [by_id[f.flow_id] for f in flows]
            reason = "the flow-scheduler answered for other flows"
        except BusError as exc:
            reason = str(exc)
        self.num_fallbacks += len(flows)
        _counter(
            self.metrics,
            "flow_fallbacks",
            "nitsum_flow_fallbacks_total",
            "flows sent at the lowest level because the flow-scheduler did not answer",
            [],
        ).inc(len(flows))
        log.info("no permit for %d flow(s) (%s): sending at P%d", len(flows), reason, self.num_levels)
        return [
            FlowPermit(f.flow_id, self.num_levels, self.dscp[self.num_levels], reason="no flow-scheduler")
            for f in flows
        ]

    async def run(self, flow_id: str, permit: FlowPermit, send: Callable[[int], Awaitable[int]]) -> int:
        """Wait for the flow's turn (strict priority), `send(level)` → bytes, report completion. A pruned
        permit (now or pushed while the flow waits) raises FlowPrunedError instead; the scheduler already
        forgot the flow."""
        if permit.pruned and permit.code == PRUNED_CODE:
            self._pruned(flow_id)
            raise FlowPrunedError(flow_id, permit.reason)
        await self._wait_turn(flow_id, max(1, permit.level))
        ok, sent, error = False, 0, ""
        level = self.levels[flow_id]
        self.turn_levels[flow_id] = level
        while len(self.turn_levels) > 4096:
            self.turn_levels.pop(next(iter(self.turn_levels)))
        try:
            sent = await send(level)
            ok = True
            return sent
        except (TransferError, BusError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.levels.pop(flow_id, None)
            self.in_flight -= 1
            self._dispatch()
            try:
                await self.bus.publish(self.bus.subjects.flow_done, FlowCompletion(flow_id, ok, sent, error))
            except Exception as exc:  # the scheduler forgets the flow on its own; the transfer is what counts
                log.debug("completion of %s not sent: %s", flow_id, exc)

    async def _wait_turn(self, flow_id: str, level: int) -> None:
        future = asyncio.get_running_loop().create_future()
        self._turn[flow_id] = future
        self.levels[flow_id] = level
        self.queue.push(flow_id, level)
        self._dispatch()
        try:
            await future
        except asyncio.CancelledError:
            if self.queue.remove(flow_id):
                self._turn.pop(flow_id, None)
                self.levels.pop(flow_id, None)
            else:  # it got its turn as it was cancelled: give the slot back
                self.levels.pop(flow_id, None)
                self.in_flight -= 1
                self._dispatch()
            raise

    def _dispatch(self) -> None:
        while self.in_flight < self.max_in_flight:
            item = self.queue.pop()
            if item is None:
                return
            flow_id, _level = item
            future = self._turn.pop(flow_id)
            self.in_flight += 1
            self.sent_order.append(flow_id)
            if not future.done():
                future.set_result(None)

    def _pruned(self, flow_id: str) -> None:
        self.num_pruned += 1
        _counter(
            self.metrics,
            "flow_pruned_stopped",
            "nitsum_flow_pruned_stopped_total",
            "flows this agent did not send because the flow-scheduler pruned their request",
            [],
        ).inc()

    async def _on_permit(self, permit: FlowPermit | FlowPruned, _delivery) -> None:
        """A promotion from the flow-scheduler: a waiting flow moves up; one in flight keeps its class.
        A pruned permit withdraws a waiting flow (its `run` raises FlowPrunedError)."""
        if isinstance(permit, FlowPruned):
            if self.on_request_pruned is not None:
                self.on_request_pruned(permit)
            return
        if permit.pruned and permit.code == PRUNED_CODE:
            future = self._turn.get(permit.flow_id)
            if future is not None and self.queue.remove(permit.flow_id):
                del self._turn[permit.flow_id]
                self.levels.pop(permit.flow_id, None)
                self._pruned(permit.flow_id)
                if not future.done():
                    future.set_exception(FlowPrunedError(permit.flow_id, permit.reason))
            return
        if self.queue.promote(permit.flow_id, permit.level):
            self.levels[permit.flow_id] = permit.level
            self.num_promotions += 1
