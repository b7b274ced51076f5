"""A standalone worker's KV hand-offs between hosts: the TCP data plane, one connection per DSCP class.

Workers of one host (same host id, `nitsum.node.kv_hosts.local_host_id`) move P/D and stage-1 KV through
shared memory (`KvMover`). Between hosts the bytes cannot: each layer flow goes over TCP
(`nitsum.transfer.tcp`: framing with CRC32, ACK once the receiver holds the bytes), on the connection of the
class its permit level maps to (IP_TOS = DSCP << 2, set before connect, so a flow's bytes all travel in the
class it had when it got its turn; a promotion reaches the flows still waiting, i.e. at layer boundaries).
The small control message (KvLayer with `via="tcp"`, its CRC32) still goes over NATS, so the receiver adopts
only bytes that an authenticated peer vouched for.

Discovery: before the first transfer to a peer, one KvPeer → KvPeerInfo round trip on `worker.<id>.kv`
(its host id, receiver address and port, and the receiver's token); cached until a send to it fails.
Every flow's END frame carries the token in `block_ids`: whoever merely reaches the port cannot place
bytes in the inbox. The inbox is bounded (bytes and age): what no KvLayer claims is dropped.
The first DATA frame carries the token as well and the receiver checks it before it buffers anything
(`TcpTransferReceiver.admit`): a stranger's flow is refused at its first frame (at most one frame's payload,
the framing's bound, is read). Still, advertise (NITSUM_KV_ADVERTISE_ADDR) an address on the cluster's network.

Counters: `nitsum_kv_tcp_bytes_total{purpose,direction,level,tos}`: bytes by the permit level they went at
and the IP_TOS read back from the sending socket (direction "sent"), and by the TOS the receiving
connection's handshake arrived with ("received", level "").
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
import zlib
from collections import OrderedDict

from prometheus_client import Counter

from nitsum.bus import Bus, BusError
from nitsum.telemetry.metrics import Metrics
from nitsum.transfer.framing import ErrorCode, TransferError
from nitsum.transfer.kv_tcp import tos_of
from nitsum.transfer.nic import link_speed_gbps
from nitsum.transfer.tcp import TcpTransferReceiver, TcpTransferSender
from nitsum.wire.messages import KvPeer, KvPeerInfo

log = logging.getLogger("nitsum.worker.kv_net")

PEER_TIMEOUT_S = 2.0  # the KvPeer round trip
SEND_TIMEOUT_S = 10.0  # one layer flow over TCP, connect to ACK
INBOX_MAX_BYTES = 1 << 30  # received layers not yet claimed by their KvLayer
INBOX_MAX_AGE_S = 30.0  # a layer whose KvLayer never came is dropped after this
MAX_FLOW_BYTES = 1 << 30


def _is_loopback(addr: str) -> bool:
    try:
        return addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class _Inbox:
    """A TcpTransferReceiver's sink: flows kept until their KvLayer claims them (token-checked, bounded)."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.flows: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.num_bytes = 0

    def admit(self, flow_id: str, block_ids: tuple[int, ...]) -> None:
        """A flow's first frame: refused unless it carries this receiver's token."""
        if len(block_ids) != 1 or block_ids[0] != self.token:
            raise TransferError(ErrorCode.SINK, "not this receiver's token", flow_id)

    def commit(self, flow_id: str, block_ids: tuple[int, ...], data: bytes) -> None:
        self.admit(flow_id, block_ids)
        self.expire()
        if self.num_bytes + len(data) > INBOX_MAX_BYTES:
            raise TransferError(ErrorCode.SINK, f"inbox full ({self.num_bytes} bytes unclaimed)", flow_id)
        self.drop(flow_id)
        self.flows[flow_id] = (time.monotonic(), data)
        self.num_bytes += len(data)

    def release(self, flow_id: str) -> None:
        pass  # nothing is reserved before a flow's END

    def take(self, flow_id: str) -> bytes | None:
        item = self.flows.pop(flow_id, None)
        if item is None:
            return None
        self.num_bytes -= len(item[1])
        return item[1]

    def drop(self, flow_id: str) -> None:
        self.take(flow_id)

    def expire(self) -> None:
        now = time.monotonic()
        while self.flows:
            fid, (at, _) = next(iter(self.flows.items()))
            if now - at <= INBOX_MAX_AGE_S:
                return
            self.drop(fid)
            log.warning("KV layer %s arrived over TCP but was never claimed: dropped", fid)


class KvNet:
    """This worker's end of the cross-host KV plane: its receiver, its senders (one per peer), its peers."""

    def __init__(
        self, bus: Bus, worker_id: str, host_id: str, addr: str, dscp: dict[int, int], metrics: Metrics
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.host_id = host_id
        self.addr = addr
        self.dscp = dict(dscp)
        self.metrics = metrics
        self.token = int.from_bytes(os.urandom(8), "big") >> 1  # never logged
        self.inbox = _Inbox(self.token)
        # loopback (one machine split into hosts): listen there only; else on every interface (the token guards it)
        bind = addr if _is_loopback(addr) else ""
        self.receiver = TcpTransferReceiver(self.inbox, host=bind, port=0, max_flow_bytes=MAX_FLOW_BYTES)
        self.receiver.on_commit = self._received
        self.receiver.admit = self.inbox.admit
        self.peers: dict[str, KvPeerInfo] = {}
        self.senders: dict[str, TcpTransferSender] = {}
        self.flow_tos: dict[str, int] = {}  # flow id -> IP_TOS of the socket that sent it (last few; tests)
        # The NIC holding the advertised address, its speed as the kernel reports it (0: loopback or unknown):
        # peers learn it in KvPeerInfo, the flow-scheduler with every flow (its links' capacity)
        measured = link_speed_gbps(addr)
        self.link_gbps, self.link_iface = measured if measured is not None else (0.0, "")

    async def start(self) -> None:
        await self.receiver.start()
        log.info("KV receiver for other hosts on %s:%d (host %s)", self.addr, self.receiver.port, self.host_id)
        if self.link_gbps:
            log.info("host %s: NIC %s at %.1f Gb/s (kernel link speed)", self.host_id, self.link_iface, self.link_gbps)

    async def close(self) -> None:
        for sender in self.senders.values():
            await sender.close()
        self.senders.clear()
        await self.receiver.close()

    def info(self) -> KvPeerInfo:
        return KvPeerInfo(self.worker_id, self.host_id, self.addr, self.receiver.port, self.token, self.link_gbps)

    def _count(self, purpose: str, direction: str, level: str, tos: int | None, n: int) -> None:
        metrics = self.metrics
        metrics.get(
            "kv_tcp_bytes",
            lambda: Counter(
                "nitsum_kv_tcp_bytes_total",
                "KV hand-off / prefix-fetch bytes over the TCP data plane, by the IP_TOS that carried them",
                ["purpose", "direction", "level", "tos"],
                registry=metrics.registry,
            ),
        ).labels(purpose=purpose, direction=direction, level=level, tos=str(tos if tos is not None else "unknown")).inc(
            n
        )

    def _received(self, flow_id: str, tos: int | None, n: int) -> None:
        purpose = flow_id.split(".")[-2] if flow_id.count(".") >= 2 else "unknown"
        self._count(purpose, "received", "", tos, n)  # the level is the sender's; the wire shows the class

    async def peer(self, dst: str) -> KvPeerInfo:
        """`dst`'s host and receiver (cached); raises TransferError when it does not answer."""
        info = self.peers.get(dst)
        if info is not None:
            return info
        try:
            info = await self.bus.request(
                self.bus.subjects.worker_kv(dst),
                KvPeer(self.worker_id, self.host_id),
                PEER_TIMEOUT_S,
                expected=KvPeerInfo,
            )
        except BusError as exc:
            raise TransferError(ErrorCode.PEER, f"{dst} did not say where its KV receiver is: {exc}") from exc
        self.peers[dst] = info
        return info

    def remote(self, info: KvPeerInfo) -> bool:
        return info.host_id != self.host_id

    async def send(self, info: KvPeerInfo, flow_id: str, payload: bytes, level: int, purpose: str) -> int:
        """One layer flow to `info`'s receiver in `level`'s class; returns the CRC32 of its bytes."""
        if not info.port:
            raise TransferError(ErrorCode.PEER, f"{info.worker_id} on host {info.host_id} has no TCP KV receiver")
        sender = self.senders.get(info.worker_id)
        if sender is None:
            sender = TcpTransferSender(info.addr, info.port, dscp_table=self.dscp, timeout_s=SEND_TIMEOUT_S)
            self.senders[info.worker_id] = sender
        try:
            await sender.send(flow_id, payload, level, block_ids=(info.token,))
        except TransferError:
            # The peer may have restarted (another port, another token): ask again next time.
            self.peers.pop(info.worker_id, None)
            self.senders.pop(info.worker_id, None)
            await sender.close()
            raise
        sock = sender.socket_for(level)
        tos = tos_of(sock) if sock is not None else None
        if tos is not None:
            self.flow_tos[flow_id] = tos
            while len(self.flow_tos) > 4096:
                self.flow_tos.pop(next(iter(self.flow_tos)))
        self._count(purpose, "sent", str(level), tos, len(payload))
        return zlib.crc32(payload)

    def take(self, flow_id: str, size_bytes: int, crc32: int) -> bytes:
        """The bytes of a layer its KvLayer announced; TransferError when absent or not the ones vouched for."""
        data = self.inbox.take(flow_id)
        if data is None:
            raise TransferError(ErrorCode.PROTOCOL, "its bytes never arrived over TCP", flow_id)
        if len(data) != size_bytes or zlib.crc32(data) != crc32:
            raise TransferError(ErrorCode.CHECKSUM, "bytes over TCP differ from what the sender announced", flow_id)
        return data
