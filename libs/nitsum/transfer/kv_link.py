"""The source side of the KV TCP plane (`nitsum.transfer.kv_tcp` describes the protocol): a `KvLink` per
(epoch, source, destination) pair with one connection per DSCP class, and `KvLinks`, an epoch's links of one
source. Blocking sockets, driven from the step thread."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nitsum.kv.reshard import Transfer
from nitsum.policy.flows import tos_for_dscp
from nitsum.transfer import kv_tcp
from nitsum.transfer.framing import ErrorCode, FrameHeader, FrameKind, TransferError
from nitsum.transfer.kv_tcp import STAGE_M_DSCP, flow_id, read_frame, tos_of, write_frame

log = logging.getLogger("nitsum.kv")


# -- the source side --------------------------------------------------------------------------------------
@dataclass
class _ClassConn:
    """One connection of a pair, in one class."""

    sock: socket.socket
    dscp: int
    tos: int  # IP_TOS read back from the socket once connected: what its packets carry
    in_flight: list[tuple[str, int]] = field(default_factory=list)  # (chunk flow id, bytes) sent, not acked yet
    bytes_sent: int = 0  # chunk bytes written on it (acked or not)


class KvLink:
    """One source -> destination pair of an epoch (the source's end): a connection per class, the first
    (`dscp`, normally the delta's STAGE_M_DSCP) opened here, every other one at its first chunk (`send`)."""

    def __init__(
        self,
        epoch: int,
        src: int,
        dst: int,
        addr: str,
        port: int,
        token: int,
        dscp: int = STAGE_M_DSCP,
        timeout_s: float = kv_tcp.CONNECT_TIMEOUT_S,
        on_open: Callable[[int], None] | None = None,
    ) -> None:
        self.epoch, self.src, self.dst = epoch, src, dst
        self.addr, self.port = addr, port
        self._token = token  # the destination receiver's (KvReceiver.token)
        self.flow_id = flow_id(epoch, src, dst)
        self.dscp = dscp  # the class of the connection opened with the link
        self.conns: dict[int, _ClassConn] = {}  # DSCP -> connection
        self.on_open = on_open  # told the TOS of every connection opened (KvCounters.kv_tos)
        self.chunks = 0
        self.broken = ""  # why this link failed (then nothing more is sent on it)
        self._open(dscp, timeout_s)

    def _open(self, dscp: int, timeout_s: float) -> _ClassConn:
        """Connect in class `dscp` and write the hello (its ack is read with the next `wait`)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_for_dscp(dscp))  # before connect: the SYN too
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(timeout_s, 0.001))  # until the hello's ack (KvLinks.connect), then IO_TIMEOUT_S
            sock.connect((self.addr, self.port))
            write_frame(
                sock,
                FrameHeader(FrameKind.END, self.flow_id, block_ids=(self.epoch, self.src, self.dst, dscp, self._token)),
            )
            conn = _ClassConn(sock, dscp, tos_of(sock), [(self.flow_id, 0)])
        except (OSError, TransferError) as exc:
            sock.close()
            raise TransferError(
                ErrorCode.CLOSED,
                f"connect to w{self.dst} at {self.addr}:{self.port} (DSCP {dscp}): {exc}",
                self.flow_id,
            ) from exc
        self.conns[dscp] = conn
        if self.on_open is not None:
            self.on_open(conn.tos)
        return conn

    def connection(self, dscp: int) -> _ClassConn:
        """The pair's connection in class `dscp`, opened now if it is the first chunk of that class."""
        conn = self.conns.get(dscp)
        if conn is None:
            conn = self._open(dscp, kv_tcp.LAZY_CONNECT_TIMEOUT_S)
            conn.sock.settimeout(kv_tcp.IO_TIMEOUT_S)
        return conn

    @property
    def sock(self) -> socket.socket:
        """The connection opened with the link (class `self.dscp`)."""
        return self.conns[self.dscp].sock

    @property
    def tos(self) -> list[int]:
        """IP_TOS of each open connection, in the order they were opened."""
        return [c.tos for c in self.conns.values() if c.sock.fileno() >= 0]

    @property
    def in_flight(self) -> list[tuple[str, int]]:
        return [item for c in self.conns.values() for item in c.in_flight]

    @property
    def bytes_by_tos(self) -> dict[int, int]:
        """Chunk bytes written, by the IP_TOS of the connection that carried them."""
        out: dict[int, int] = {}
        for c in self.conns.values():
            if c.bytes_sent:
                out[c.tos] = out.get(c.tos, 0) + c.bytes_sent
        return out

    def send(
        self,
        t: Transfer,
        start: int,
        end: int,
        old_kv: torch.Tensor,
        old_heads: tuple[int, int],
        dscp: int = STAGE_M_DSCP,
    ) -> int:
        """Blocks [start, end) of transfer `t` from this worker's old cache, on the pair's connection of class
        `dscp`; returns their bytes (not yet acked)."""
        conn = self.connection(dscp)
        src_index = torch.tensor(t.src_block_ids[start:end], dtype=torch.long)
        h0, h1 = t.head_start - old_heads[0], t.head_end - old_heads[0]
        chunk = old_kv[t.layer_start : t.layer_end, :, src_index, :, h0:h1].contiguous()
        # As raw bytes: numpy has no bfloat16, and the receiver views them in its cache's dtype anyway.
        data = memoryview(chunk.view(-1).view(torch.uint8).numpy())
        fid = f"{self.flow_id}-c{self.chunks}"
        self.chunks += 1
        placement = (t.layer_start, t.layer_end, t.head_start, t.head_end, *t.dst_block_ids[start:end])
        try:
            write_frame(conn.sock, FrameHeader(FrameKind.DATA, fid), data)
            write_frame(conn.sock, FrameHeader(FrameKind.END, fid, total_bytes=len(data), block_ids=placement))
        except TransferError as exc:
            raise self._refusal_or(conn, exc) from exc
        conn.in_flight.append((fid, len(data)))
        conn.bytes_sent += len(data)
        return len(data)

    def _refusal_or(self, conn: _ClassConn, exc: TransferError) -> TransferError:
        """A write failed: if the receiver had refused something before (an ERROR waits to be read), that
        refusal is the reason worth reporting; otherwise `exc`."""
        try:
            conn.sock.settimeout(kv_tcp.ERROR_PEEK_S)
            while True:
                header, _ = read_frame(conn.sock, 0)
                if header.kind is FrameKind.ERROR:
                    return TransferError(
                        ErrorCode.PEER, f"receiver w{self.dst}: {header.code}: {header.message}", header.flow_id
                    )
        except (TransferError, OSError):
            return exc

    def wait(self, deadline: float | None = None) -> int:
        """Every ack of what was sent, on every class (the hellos' included); returns the acked chunk bytes.
        `deadline` (monotonic) bounds the whole wait, not each read: connections and links waited one after
        another share one budget."""
        return sum(self._wait(conn, deadline) for conn in list(self.conns.values()))

    def _wait(self, conn: _ClassConn, deadline: float | None) -> int:
        acked = 0
        try:
            while conn.in_flight:
                fid, size = conn.in_flight[0]
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TransferError(ErrorCode.TIMEOUT, f"acks of w{self.dst} not in time", fid)
                    conn.sock.settimeout(left)
                header, _ = read_frame(conn.sock, 0)
                if header.kind is FrameKind.ERROR:
                    raise TransferError(
                        ErrorCode.PEER, f"receiver w{self.dst}: {header.code}: {header.message}", header.flow_id
                    )
                if header.kind is not FrameKind.ACK or header.flow_id != fid or header.total_bytes != size:
                    raise TransferError(
                        ErrorCode.PROTOCOL, f"expected the ack of {fid}, got {header.kind.value} {header.flow_id}", fid
                    )
                conn.in_flight.pop(0)
                acked += size
        finally:
            if deadline is not None and conn.sock.fileno() >= 0:
                conn.sock.settimeout(kv_tcp.IO_TIMEOUT_S)
        return acked

    def close(self) -> None:
        for conn in self.conns.values():
            conn.sock.close()


class KvLinks:
    """A source's links of one epoch, one per destination on another host (each a connection per class).
    `on_open` is told the IP_TOS of every connection opened, in prepare or later (KvCounters.kv_tos)."""

    def __init__(self, on_open: Callable[[int], None] | None = None) -> None:
        self.links: dict[int, KvLink] = {}
        self.on_open = on_open

    def connect(self, epoch: int, src: int, targets: dict[int, tuple[str, int, int]], dscp: int = STAGE_M_DSCP) -> None:
        """Connect to every destination (address, port, its receiver's token) in class `dscp` and wait for each
        hello's ack; TransferError on the first that fails (the links made so far stay, for `close`)."""
        deadline = time.monotonic() + kv_tcp.CONNECT_TIMEOUT_S  # one budget for all: unreachable peers do not add up
        for dst, (addr, port, token) in sorted(targets.items()):
            self.links[dst] = KvLink(
                epoch, src, dst, addr, port, token, dscp, deadline - time.monotonic(), self.on_open
            )
        for link in self.links.values():
            link.wait(deadline)
            link.sock.settimeout(kv_tcp.IO_TIMEOUT_S)

    def __contains__(self, dst: int) -> bool:
        return dst in self.links

    def link(self, dst: int) -> KvLink:
        return self.links[dst]

    @property
    def tos(self) -> list[int]:
        return [tos for link in self.links.values() for tos in link.tos]

    @property
    def open_connections(self) -> int:
        return sum(1 for link in self.links.values() for c in link.conns.values() if c.sock.fileno() >= 0)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
