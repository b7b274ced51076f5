"""The worker's KV hand-offs and prefix fetches, riding on its transfer agent (`flow_agent.TransferAgent`: the
flow-scheduler's permits, flows queued by level, completions reported).

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

import torch

from nitsum.bus import Bus, BusError
from nitsum.engine.migration import layer_bytes
from nitsum.telemetry.metrics import Metrics
from nitsum.transfer.framing import ErrorCode, TransferError
from nitsum.transfer.shm import ShmPublisher
from nitsum.wire.messages import (
    FlowSubmit,
    KvAck,
    KvFetch,
    KvFetchReply,
    KvLayer,
    KvPeer,
    KvPeerInfo,
    LayerProgress,
)
from nitsum_services.worker.flow_agent import FlowPrunedError, TransferAgent, _counter
from nitsum_services.worker.kv_access import export_cached_blocks, export_kv
from nitsum_services.worker.kv_incoming import IncomingTransfers

log = logging.getLogger("nitsum.worker.transfer")

LAYER_TIMEOUT_S = 10.0  # one layer's round trip (receiver copy-out; the last one includes the import)
FETCH_TIMEOUT_S = 5.0  # a stage-1 fetch that takes longer is abandoned: the prefill computes it instead


def _now_unix_ms() -> float:
    return time.time() * 1000.0


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
        self.incoming = IncomingTransfers(session, net, self._count)  # the receiving side
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
        return await self.incoming.on_layer(msg)

    @property
    def num_imported(self) -> int:
        """P/D hand-offs this worker adopted."""
        return self.incoming.num_imported

    @property
    def num_reused_blocks(self) -> int:
        """Prefix blocks fetched from other workers into this one's cache."""
        return self.incoming.num_reused_blocks

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
        payloads = [layer_bytes(kv, layer) for layer in range(num_layers)]
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
                src_link_gbps=self.net.link_gbps if remote else 0.0,
                dst_link_gbps=peer.link_gbps if remote else 0.0,
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
            export = await self.session.call(lambda backend: export_kv(backend, rid))
            now, tpot = _now_unix_ms(), max(running.tpot_ms, 1.0)
            await self._send_layers(
                rid,
                "pd",
                running.decode_worker,
                export.kv,
                export.header(),
                running.stream_subject,
                (),
                "3",
                now + tpot * 4,
                now + tpot * max(running.max_tokens - running.next_index, 1),  # the tokens it has left
                running.attempt,
            )
        except FlowPrunedError as exc:
            reason, pruned = exc.reason or "pruned by the flow-scheduler", True
        except Exception as exc:  # whatever failed (the wire, the peer, a gather), the request is re-run elsewhere
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
            found, kv = await self.session.call(lambda backend: export_cached_blocks(backend, list(msg.block_hashes)))
        except Exception as exc:  # the asker then computes the prefix itself
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
