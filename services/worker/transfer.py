"""The worker's transfer agent and its KV hand-offs (the async half of Nuska inside a worker).

`TransferAgent`: asks the flow-scheduler for permits (one FlowSubmitBatch per request), queues flows by
level (`nitsum.transfer.agent.PriorityFlowQueue`: P1 first), takes promotions pushed on
`flow.permit.<worker>`, and reports every flow's completion. The scheduler is advice, never a gate: when it
does not answer in time a flow goes at the lowest level anyway (counted in `nitsum_flow_fallbacks_total`).

`KvMover`: the two KV paths that ride on the agent, both layer by layer, bytes in shared memory (this
host; `nitsum.transfer.shm`), the small handle over NATS (`worker.<id>.kv`, KvLayer → KvAck):
- P/D (stage 3): a prefill worker exports a finished prefill, ships it to its decode worker, which adopts
  the request when the last layer landed and streams on from output index 1; the prefill worker releases
  its KV once the decode worker answered (either way).
- KV reuse (stage 1): a worker about to prefill asks the worker holding the prompt's prefix
  (`worker.<id>.kvfetch`); the holder pushes the cached blocks back, the asker imports them into its prefix
  cache, and its engine then computes only the rest of the prompt.
Cross-host transfers (TCP per class with the permit's DSCP, as `nitsum.transfer.kv_tcp` does for TP changes)
are not wired here yet: P/D and reuse pairs are chosen within one node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from prometheus_client import Counter

from nitsum.bus import Bus, BusError
from nitsum.engine.migration import KVExport, layer_bytes, stack_layers
from nitsum.policy.flows import dscp_table
from nitsum.telemetry.metrics import Metrics
from nitsum.transfer.agent import PriorityFlowQueue
from nitsum.transfer.framing import ErrorCode, TransferError
from nitsum.transfer.shm import ShmHandle, ShmPublisher, receive
from nitsum.wire.messages import (
    FlowCompletion,
    FlowPermit,
    FlowPermitBatch,
    FlowSubmit,
    FlowSubmitBatch,
    KvAck,
    KvFetch,
    KvFetchReply,
    KvLayer,
)

log = logging.getLogger("nitsum.worker.transfer")

PERMIT_TIMEOUT_S = 0.5  # past this a flow goes at the lowest level without its permit
LAYER_TIMEOUT_S = 10.0  # one layer's round trip (receiver copy-out; the last one includes the import)
PENDING_TIMEOUT_S = 30.0  # a receiver forgets a partial transfer whose sender went quiet
FETCH_TIMEOUT_S = 5.0  # a stage-1 fetch that takes longer is abandoned: the prefill computes it instead
MAX_IN_FLIGHT = 2  # flows this agent sends at once; the rest wait in strict priority order
# A node-world worker's agent carries TP-migration flows only (KV hand-offs need standalone workers); their
# chunks run in the step thread, one round of every running flow per step, so a low limit would only make
# pairs that can move together wait for each other (8 workers: at most 8 x 8 pairs).
NODE_MAX_IN_FLIGHT = 64
NUM_LEVELS = 8
# Test-only fault injection: the sender corrupts the checksum of every P/D layer, so the receiver refuses it.


def _counter(metrics: Metrics, key: str, name: str, doc: str, labels: list[str]) -> Counter:
    return metrics.get(key, lambda: Counter(name, doc, labels, registry=metrics.registry))


def _now_unix_ms() -> float:
    return time.time() * 1000.0


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

    async def start(self) -> None:
        await self.bus.subscribe(self.bus.subjects.flow_permit(self.worker_id), self._on_permit, expected=FlowPermit)

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
        """Wait for the flow's turn (strict priority), `send(level)` → bytes, report completion."""
        await self._wait_turn(flow_id, max(1, permit.level))
        ok, sent, error = False, 0, ""
        try:
            sent = await send(self.levels[flow_id])
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

    async def _on_permit(self, permit: FlowPermit, _delivery) -> None:
        """A promotion from the flow-scheduler: a waiting flow moves up; one in flight keeps its class."""
        if self.queue.promote(permit.flow_id, permit.level):
            self.levels[permit.flow_id] = permit.level
            self.num_promotions += 1


@dataclass
class _Pending:
    """Layers of one incoming transfer, until the last one lands."""

    num_layers: int
    state: bytes
    stream_subject: str
    block_hashes: tuple[int, ...]
    started_s: float = field(default_factory=time.monotonic)
    layers: dict[int, bytes] = field(default_factory=dict)


class KvMover:
    """P/D hand-offs and stage-1 prefix fetches of one worker, sender and receiver sides."""

    def __init__(self, session, agent: TransferAgent, bus: Bus, worker_id: str, metrics: Metrics) -> None:
        self.session = session
        self.agent = agent
        self.bus = bus
        self.worker_id = worker_id
        self.metrics = metrics
        self.publisher = ShmPublisher()
        self.pending: dict[tuple[str, str], _Pending] = {}
        self.num_imported = 0
        self.num_reused_blocks = 0
        self.num_failures = 0
        self.corrupt = False  # fault injection (NITSUM_FAULT_KV_CORRUPT), set by the worker from its config

    async def start(self) -> None:
        await self.bus.subscribe(
            self.bus.subjects.worker_kv(self.worker_id), self.on_layer, expected=KvLayer, concurrent=True
        )
        await self.bus.subscribe(
            self.bus.subjects.worker_kv_fetch(self.worker_id), self.on_fetch, expected=KvFetch, concurrent=True
        )

    def close(self) -> None:
        self.publisher.close()

    def _count(self, purpose: str, outcome: str) -> None:
        _counter(
            self.metrics,
            "kv_transfers",
            "nitsum_kv_transfers_total",
            "KV hand-offs (pd) and prefix fetches (reuse) by outcome",
            ["purpose", "outcome"],
        ).labels(purpose=purpose, outcome=outcome).inc()
        if outcome != "ok":
            self.num_failures += 1

    # ---- sending ---------------------------------------------------------------------------------
    async def _send_layers(
        self,
        request_id: str,
        purpose: str,
        dst: str,
        kv: torch.Tensor,
        state: bytes,
        stream_subject: str,
        block_hashes: tuple[int, ...],
        stage: str,
        deadline_unix_ms: float | None,
    ) -> None:
        """Every layer of `kv` to `dst` as one flow each; raises TransferError unless all landed and `dst`
        adopted them (the ack of the last layer says `complete`)."""
        num_layers = int(kv.shape[0])
        payloads = [layer_bytes(kv, layer) for layer in range(num_layers)]
        flows = [
            FlowSubmit(
                flow_id=f"{request_id}.{purpose}.{layer}",
                request_id=request_id,
                unit_id=request_id,
                stage=stage,
                size_bytes=len(payloads[layer]),
                src=self.worker_id,
                dst=dst,
                target_layer=layer,
                deadline_unix_ms=deadline_unix_ms,
                request_deadlines_unix_ms=(deadline_unix_ms,) if deadline_unix_ms is not None else (),
            )
            for layer in range(num_layers)
        ]
        permits = await self.agent.permits(flows)
        acks: list[KvAck] = []

        async def one(layer: int) -> int:
            flow = flows[layer]

            async def send(_level: int) -> int:
                handle = self.publisher.publish(flow.flow_id, payloads[layer])
                crc = handle.crc32 ^ 1 if self.corrupt and purpose == "pd" else handle.crc32
                try:
                    ack = await self.bus.request(
                        self.bus.subjects.worker_kv(dst),
                        KvLayer(
                            request_id,
                            self.worker_id,
                            purpose,
                            layer,
                            num_layers,
                            flow.flow_id,
                            handle.segment,
                            handle.size_bytes,
                            crc,
                            state=state,
                            stream_subject=stream_subject,
                            block_hashes=block_hashes,
                        ),
                        LAYER_TIMEOUT_S,
                        expected=KvAck,
                    )
                finally:
                    self.publisher.release(handle)  # the receiver copied it out, or gave up: either way
                if not ack.ok:
                    raise TransferError(ErrorCode.PEER, f"{dst}: {ack.reason}", flow.flow_id)
                acks.append(ack)
                return handle.size_bytes

            return await self.agent.run(flow.flow_id, permits[layer], send)

        results = await asyncio.gather(*(one(layer) for layer in range(num_layers)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            first = errors[0]
            if isinstance(first, TransferError):
                raise first
            raise TransferError(ErrorCode.PEER, f"{type(first).__name__}: {first}", request_id)
        if not any(a.complete for a in acks):
            raise TransferError(ErrorCode.PROTOCOL, "every layer acked but none completed the transfer", request_id)

    async def hand_off(self, running) -> None:
        """Prefill side of P/D: export the pinned request, ship it, release it here. Never raises."""
        rid = running.request_id
        span = running.span
        reason = ""
        try:
            export = await self.session.call(lambda backend: backend.engine.export_kv(rid))
            deadline = _now_unix_ms() + max(running.tpot_ms, 1.0) * 4
            await self._send_layers(
                rid,
                "pd",
                running.decode_worker,
                export.kv,
                export.header(),
                running.stream_subject,
                (),
                "3",
                deadline,
            )
        except (TransferError, BusError, KeyError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self.session.release_pinned(rid)
        if not reason:
            span.add_event("handed_off", {"nitsum.decode_worker": running.decode_worker})
            self._count("pd", "ok")
            self.session.handed_off(rid)
            return
        self._count("pd", "failed")
        log.warning(
            "KV hand-off of %s to %s failed: %s; the request is re-run elsewhere", rid, running.decode_worker, reason
        )
        # A retryable code: the gateway re-submits it (with the first token) and the coordinator runs it hybrid.
        await self.session.fail(
            rid, "engine_error", f"kv_transfer_failed: hand-off to {running.decode_worker}: {reason}"
        )

    async def on_fetch(self, msg: KvFetch, _delivery) -> KvFetchReply:
        """Holder side of stage 1: push the cached blocks of this prefix to the asker."""
        try:
            found, kv = await self.session.call(
                lambda backend: backend.engine.export_cached_blocks(list(msg.block_hashes))
            )
        except (AttributeError, AssertionError) as exc:
            return KvFetchReply(msg.request_id, False, reason=f"cannot export blocks here: {exc}")
        if not found:
            return KvFetchReply(msg.request_id, True, 0, reason="no longer cached")
        try:
            await self._send_layers(
                msg.request_id, "reuse", msg.dst_worker, kv, b"", "", tuple(found), "1", msg.deadline_unix_ms
            )
        except (TransferError, BusError) as exc:
            self._count("reuse", "failed")
            return KvFetchReply(msg.request_id, False, reason=f"{type(exc).__name__}: {exc}")
        self._count("reuse", "ok")
        return KvFetchReply(msg.request_id, True, len(found))

    async def fetch(
        self, request_id: str, holder: str, block_hashes: tuple[int, ...], deadline_unix_ms: float | None
    ) -> int:
        """Asker side of stage 1: blocks imported (0 when the holder had none or the fetch failed)."""
        try:
            reply = await self.bus.request(
                self.bus.subjects.worker_kv_fetch(holder),
                KvFetch(request_id, self.worker_id, block_hashes, deadline_unix_ms),
                FETCH_TIMEOUT_S,
                expected=KvFetchReply,
            )
        except BusError as exc:
            self._count("reuse", "failed")
            log.info("prefix fetch for %s from %s failed (%s): computing it", request_id, holder, exc)
            return 0
        if not reply.ok:
            self._count("reuse", "failed")
            log.info("prefix fetch for %s from %s refused (%s): computing it", request_id, holder, reply.reason)
            return 0
        return reply.num_blocks

    # ---- receiving -------------------------------------------------------------------------------
    async def on_layer(self, msg: KvLayer, _delivery) -> KvAck:
        self._expire()
        key = (msg.request_id, msg.purpose)
        try:
            data = receive(ShmHandle(msg.flow_id, msg.segment, msg.size_bytes, msg.crc32))
        except TransferError as exc:
            self.pending.pop(key, None)
            self._count(msg.purpose, "failed")
            log.warning("KV layer %d of %s from %s refused: %s", msg.layer, msg.request_id, msg.src_worker, exc)
            return KvAck(msg.request_id, msg.layer, False, f"{exc.code.value}: {exc.message}")
        pending = self.pending.setdefault(
            key, _Pending(msg.num_layers, msg.state, msg.stream_subject, msg.block_hashes)
        )
        pending.layers[msg.layer] = data
        if len(pending.layers) < pending.num_layers:
            return KvAck(msg.request_id, msg.layer, True)
        del self.pending[key]
        try:
            if msg.purpose == "pd":
                await self._adopt(msg.request_id, pending)
            else:
                await self._import_blocks(pending)
        except (TransferError, ValueError, AssertionError, RuntimeError) as exc:
            self._count(msg.purpose, "failed")
            log.warning("KV of %s from %s not adopted: %s", msg.request_id, msg.src_worker, exc)
            return KvAck(msg.request_id, msg.layer, False, f"{type(exc).__name__}: {exc}")
        return KvAck(msg.request_id, msg.layer, True, complete=True)

    async def _adopt(self, request_id: str, pending: _Pending) -> None:
        export = KVExport.from_layers(pending.state, pending.layers)
        state = export.state
        produced = len(state["tokens"]) - len(state["prompt"])
        # Registered before the import so the step that follows it finds the stream to publish to.
        self.session.adopt(request_id, pending.stream_subject, len(state["prompt"]), produced)
        try:
            ok = await self.session.call(lambda backend: backend.engine.import_request(export))
        except BaseException:
            self.session.forget(request_id)
            raise
        if not ok:
            self.session.forget(request_id)
            raise TransferError(ErrorCode.SINK, "no room in the KV cache now", request_id)
        self.num_imported += 1

    async def _import_blocks(self, pending: _Pending) -> None:
        # Reuse flows carry raw blocks of the same model, so this engine's cache gives dtype and shape
        # (a mismatch fails the view with RuntimeError, reported as a failed fetch).
        num_blocks = len(pending.block_hashes)

        def do_import(backend) -> int:
            engine = backend.engine
            cache = engine.runner.kv_cache  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
            shape = [2, num_blocks, *cache.shape[3:]]
            kv = stack_layers(pending.layers, str(cache.dtype).removeprefix("torch."), shape)
            return engine.import_cached_blocks(list(pending.block_hashes), kv)

        self.num_reused_blocks += await self.session.call(do_import)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self.pending.items() if now - p.started_s > PENDING_TIMEOUT_S]:
            del self.pending[key]
            self._count(key[1], "failed")
            log.warning("partial KV transfer of %s (%s) expired", *key)
