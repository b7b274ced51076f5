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
Between hosts (the peer's host id differs, learnt once per peer: `kv_net.KvNet.peer`) every layer's bytes
go over the TCP data plane in the DSCP class of the level the flow has when it gets its turn (`kv_net`); the
KvLayer over NATS then says `via="tcp"` and carries their CRC32.

Permits and pruning: every layer is one flow. A flow waiting for its turn that the flow-scheduler promotes
moves up (so promotions take effect at layer boundaries: a layer in flight keeps its class). A pruned
permit (code "overload_pruned", at submit or pushed later) stops the request's flows that have not gone
yet: a P/D hand-off then fails with a retryable error (the gateway re-submits the request, the
coordinator re-plans it hybrid), a stage-1 fetch is abandoned (the asker computes the prefix).
Layer progress: a prefill worker reports each hand-off to the flow-scheduler (LayerProgress on
`flow.progress`, off the step thread) once its compute finished and its layers are submitted: the last
layer, `done`, and the request's deadline (the engine computes every layer of a prefill in one forward, so
that is the one layer boundary a flow exists at).
Deadlines of a hand-off: its flows' own (`deadline_unix_ms`, RMLQ's urgency) are 4 TPOTs after the prefill,
as before; the request's (`request_deadlines_unix_ms`, what pruning tests) is the latest the decode worker
could resume and still meet the TPOT target over the request's remaining tokens (were decoding free): a
request pruned against it cannot meet its target in any case. A stage-1 fetch has the TTFT deadline for both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgpack
import torch
from prometheus_client import Counter

from nitsum.bus import Bus, BusError
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
    KvPeer,
    KvPeerInfo,
    LayerProgress,
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
PRUNED_CODE = "overload_pruned"  # FlowPermit.code of a request the flow-scheduler pruned (retry it)


class FlowPrunedError(TransferError):
    """The flow-scheduler pruned this flow's request: nothing more of it is sent."""

    def __init__(self, flow_id: str, reason: str) -> None:
        super().__init__(ErrorCode.PEER, f"pruned by the flow-scheduler: {reason}", flow_id)
        self.reason = reason


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
        self.turn_levels: dict[str, int] = {}  # flow id -> the level it went at (last few; tests, tracing)
        self.num_pruned = 0

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

    async def _on_permit(self, permit: FlowPermit, _delivery) -> None:
        """A promotion from the flow-scheduler: a waiting flow moves up; one in flight keeps its class.
        A pruned permit withdraws a waiting flow (its `run` raises FlowPrunedError)."""
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


@dataclass
class _Pending:
    """Layers of one incoming transfer, until the last one lands."""

    num_layers: int
    state: bytes
    stream_subject: str
    block_hashes: tuple[int, ...]
    attempt: int = -1
    started_s: float = field(default_factory=time.monotonic)
    layers: dict[int, bytes] = field(default_factory=dict)


def _pack_header(export) -> bytes:
    dtype = str(export.kv.dtype).removeprefix("torch.")
    return msgpack.packb(
        [export.state, export.num_tokens, list(export.heads), dtype, list(export.kv.shape[1:])], use_bin_type=True
    )


def _layer_bytes(kv: torch.Tensor, layer: int) -> bytes:
    return kv[layer].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _stack_layers(layers: dict[int, bytes], dtype: str, layer_shape: list[int]) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype)
    parts = [
        torch.frombuffer(bytearray(layers[i]), dtype=torch.uint8).view(torch_dtype).view(layer_shape)
        for i in range(len(layers))
    ]
    return torch.stack(parts)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]


class KvMover:
    """P/D hand-offs and stage-1 prefix fetches of one worker, sender and receiver sides."""

    def __init__(
        self, session, agent: TransferAgent, bus: Bus, worker_id: str, metrics: Metrics, net=None, host_id: str = ""
    ) -> None:
        self.session = session
        self.agent = agent
        self.bus = bus
        self.worker_id = worker_id
        self.metrics = metrics
        self.net = net  # kv_net.KvNet: transfers to workers on other hosts (None: shared memory only)
        self.host_id = net.host_id if net is not None else host_id
        self._background: set[asyncio.Task] = set()
        self.publisher = ShmPublisher()
        self.pending: dict[tuple[str, str], _Pending] = {}
        self.num_imported = 0
        self.num_reused_blocks = 0
        self.num_failures = 0
        self.corrupt = False  # fault injection (NITSUM_FAULT_KV_CORRUPT), set by the worker from its config

    async def start(self) -> None:
        if self.net is not None:
            await self.net.start()
        await self.bus.subscribe(
            self.bus.subjects.worker_kv(self.worker_id), self.on_kv, expected=(KvLayer, KvPeer), concurrent=True
        )
        await self.bus.subscribe(
            self.bus.subjects.worker_kv_fetch(self.worker_id), self.on_fetch, expected=KvFetch, concurrent=True
        )

    def close(self) -> None:
        self.publisher.close()

    async def aclose(self) -> None:
        self.close()
        if self.net is not None:
            await self.net.close()

    async def on_kv(self, msg: KvLayer | KvPeer, delivery) -> KvAck | KvPeerInfo:
        if isinstance(msg, KvPeer):
            return self.net.info() if self.net is not None else KvPeerInfo(self.worker_id, self.host_id)
        return await self.on_layer(msg, delivery)

    def report_progress(
        self, unit_id: str, layer: int, deadline_unix_ms: float | None, done: bool = False, flows=()
    ) -> None:
        """LayerProgress to the flow-scheduler, in the background (never on the step thread, never raises)."""
        msg = LayerProgress(
            unit_id, layer, (deadline_unix_ms,) if deadline_unix_ms is not None else (), tuple(flows), done
        )

        async def publish() -> None:
            try:
                await self.bus.publish(self.bus.subjects.flow_progress, msg)
            except Exception as exc:  # advice only: the scheduler then works from submits and completions
                log.debug("layer progress of %s not sent: %s", unit_id, exc)

        task = asyncio.create_task(publish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
        request_deadline_unix_ms: float | None = None,
        attempt: int = -1,
    ) -> None:
        """Every layer of `kv` to `dst` as one flow each; raises TransferError unless all landed and `dst`
        adopted them (the ack of the last layer says `complete`)."""
        num_layers = int(kv.shape[0])
        if request_deadline_unix_ms is None:
            request_deadline_unix_ms = deadline_unix_ms
        payloads = [_layer_bytes(kv, layer) for layer in range(num_layers)]
        peer = await self.net.peer(dst) if self.net is not None else None
        remote = peer is not None and self.net.remote(peer)
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
                request_deadlines_unix_ms=(request_deadline_unix_ms,) if request_deadline_unix_ms is not None else (),
                # across hosts the flow runs on the two hosts' NIC links; on one host on the workers' own
                src_host=self.host_id if remote else "",
                dst_host=peer.host_id if remote else "",
            )
            for layer in range(num_layers)
        ]
        permits = await self.agent.permits(flows)
        if stage == "3":  # compute is done: every layer is available, its flows move on the timer now
            self.report_progress(request_id, num_layers, request_deadline_unix_ms, done=True)
        acks: list[KvAck] = []

        async def one(layer: int) -> int:
            flow = flows[layer]

            async def send(level: int) -> int:
                if remote:
                    return await send_tcp(level)
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
                            attempt=attempt,
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

            async def send_tcp(level: int) -> int:
                crc = await self.net.send(peer, flow.flow_id, payloads[layer], level, purpose)
                crc = crc ^ 1 if self.corrupt and purpose == "pd" else crc
                layer_msg = KvLayer(
                    request_id,
                    self.worker_id,
                    purpose,
                    layer,
                    num_layers,
                    flow.flow_id,
                    "",
                    len(payloads[layer]),
                    crc,
                    state=state,
                    stream_subject=stream_subject,
                    block_hashes=block_hashes,
                    via="tcp",
                    attempt=attempt,
                )
                ack = await self.bus.request(
                    self.bus.subjects.worker_kv(dst), layer_msg, LAYER_TIMEOUT_S, expected=KvAck
                )
                if not ack.ok:
                    raise TransferError(ErrorCode.PEER, f"{dst}: {ack.reason}", flow.flow_id)
                acks.append(ack)
                return len(payloads[layer])

            return await self.agent.run(flow.flow_id, permits[layer], send)

        results = await asyncio.gather(*(one(layer) for layer in range(num_layers)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            pruned = [e for e in errors if isinstance(e, FlowPrunedError)]
            first = pruned[0] if pruned else errors[0]
            if isinstance(first, TransferError):
                raise first
            raise TransferError(ErrorCode.PEER, f"{type(first).__name__}: {first}", request_id)
        if not any(a.complete for a in acks):
            raise TransferError(ErrorCode.PROTOCOL, "every layer acked but none completed the transfer", request_id)

    async def hand_off(self, running) -> None:
        """Prefill side of P/D: export the pinned request, ship it, release it here. Never raises."""
        rid = running.request_id
        span = running.span
        reason, pruned = "", False
        try:
            export = await self.session.call(lambda backend: backend.engine.export_kv(rid))
            now, tpot = _now_unix_ms(), max(running.tpot_ms, 1.0)
            await self._send_layers(
                rid,
                "pd",
                running.decode_worker,
                export.kv,
                _pack_header(export),
                running.stream_subject,
                (),
                "3",
                now + tpot * 4,
                now + tpot * max(running.max_tokens - 1, 1),
                running.attempt,
            )
        except FlowPrunedError as exc:
            reason, pruned = exc.reason or "pruned by the flow-scheduler", True
        except (TransferError, BusError, KeyError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self.session.release_pinned(rid)
        if not reason:
            span.add_event("handed_off", {"nitsum.decode_worker": running.decode_worker})
            self._count("pd", "ok")
            self.session.handed_off(rid)
            return
        self._count("pd", "pruned" if pruned else "failed")
        log.warning(
            "KV hand-off of %s to %s failed: %s; the request is re-run elsewhere", rid, running.decode_worker, reason
        )
        # A retryable code: the gateway re-submits it (with the first token) and the coordinator runs it hybrid.
        what = "kv_transfer_pruned" if pruned else "kv_transfer_failed"
        await self.session.fail(rid, "engine_error", f"{what}: hand-off to {running.decode_worker}: {reason}")

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
            self._count("reuse", "pruned" if isinstance(exc, FlowPrunedError) else "failed")
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
            data = self._layer_data(msg)
        except TransferError as exc:
            self.pending.pop(key, None)
            self._count(msg.purpose, "failed")
            log.warning("KV layer %d of %s from %s refused: %s", msg.layer, msg.request_id, msg.src_worker, exc)
            return KvAck(msg.request_id, msg.layer, False, f"{exc.code.value}: {exc.message}")
        pending = self.pending.setdefault(
            key, _Pending(msg.num_layers, msg.state, msg.stream_subject, msg.block_hashes, msg.attempt)
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

    def _layer_data(self, msg: KvLayer) -> bytes:
        if msg.via == "tcp":
            if self.net is None:
                raise TransferError(ErrorCode.PROTOCOL, "this worker has no TCP KV receiver", msg.flow_id)
            return self.net.take(msg.flow_id, msg.size_bytes, msg.crc32)
        if msg.via:
            raise TransferError(ErrorCode.PROTOCOL, f"unknown KV path {msg.via!r}", msg.flow_id)
        return receive(ShmHandle(msg.flow_id, msg.segment, msg.size_bytes, msg.crc32))

    async def _adopt(self, request_id: str, pending: _Pending) -> None:
        from nitsum.engine.migration import KVExport

        state, num_tokens, heads, dtype, layer_shape = msgpack.unpackb(pending.state, raw=False)
        kv = _stack_layers(pending.layers, dtype, layer_shape)
        export = KVExport(state, int(num_tokens), (int(heads[0]), int(heads[1])), kv)
        produced = len(state["tokens"]) - len(state["prompt"])
        # Registered before the import so the step that follows it finds the stream to publish to.
        self.session.adopt(request_id, pending.stream_subject, len(state["prompt"]), produced, pending.attempt)
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
            kv = _stack_layers(pending.layers, str(cache.dtype).removeprefix("torch."), shape)
            return engine.import_cached_blocks(list(pending.block_hashes), kv)

        self.num_reused_blocks += await self.session.call(do_import)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self.pending.items() if now - p.started_s > PENDING_TIMEOUT_S]:
            del self.pending[key]
            self._count(key[1], "failed")
            log.warning("partial KV transfer of %s (%s) expired", *key)
