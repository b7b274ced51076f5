"""The receiving side of a worker's KV transfers (`KvMover`'s): the layers of each incoming transfer, from
shared memory or the TCP data plane, until the last one lands; then a P/D hand-off's request is adopted
(streamed on from its next output index) and a stage-1 fetch's blocks go into the prefix cache."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nitsum.engine.migration import KVExport, stack_layers
from nitsum.node.handoff import HandoffError
from nitsum.transfer.framing import ErrorCode, TransferError
from nitsum.transfer.shm import ShmHandle, receive
from nitsum.wire.messages import KvAck, KvLayer
from nitsum_services.worker.kv_access import import_cached_blocks, import_request, spread

log = logging.getLogger("nitsum.worker.transfer")

PENDING_TIMEOUT_S = 30.0  # a receiver forgets a partial transfer whose sender went quiet


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


class IncomingTransfers:
    def __init__(self, session, net, count: Callable[[str, str], None]) -> None:
        self.session = session
        self.net = net  # kv_net.KvNet: layers from workers on other hosts (None: shared memory only)
        self._count = count  # (purpose, outcome) of a transfer, counted by the mover
        self.pending: dict[tuple[str, str], _Pending] = {}
        self.num_imported = 0
        self.num_reused_blocks = 0

    async def on_layer(self, msg: KvLayer) -> KvAck:
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
        except (TransferError, HandoffError, OSError, ValueError, AssertionError, RuntimeError) as exc:
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
        export = KVExport.from_layers(pending.state, pending.layers)
        state = export.state
        produced = len(state["tokens"]) - len(state["prompt"])
        # Registered before the import so the step that follows it finds the stream to publish to.
        self.session.adopt(request_id, pending.stream_subject, len(state["prompt"]), produced, pending.attempt)
        try:
            ok = await self.session.call(lambda backend: import_request(backend, export))
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
            cache = backend.engine.runner.kv_cache  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
            # every KV head travels (a TP>1 group's leader holds only its own: the model's count then)
            heads = backend.runtime.layout.model_config.num_kv_heads if spread(backend) else cache.shape[4]
            shape = [2, num_blocks, cache.shape[3], heads, cache.shape[5]]
            kv = stack_layers(pending.layers, str(cache.dtype).removeprefix("torch."), shape)
            return import_cached_blocks(backend, list(pending.block_hashes), kv)

        self.num_reused_blocks += await self.session.call(do_import)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self.pending.items() if now - p.started_s > PENDING_TIMEOUT_S]:
            del self.pending[key]
            self._count(key[1], "failed")
            log.warning("partial KV transfer of %s (%s) expired", *key)
