"""A TP transition's KV across hosts: the transfer data plane's framing over TCP, one connection per DSCP class.

Workers of one host write migrated blocks straight into each other's new caches (shared memory,
`kv_segment`). A source on another host cannot: it sends each chunk to the destination's `KvReceiver`,
which writes it into the new cache and acks *after* the write. A source counts a chunk done only on its
ack, so when every source of a commit has its acks the delta has landed everywhere and the barrier after it
is safe.

Protocol (frames of `nitsum.transfer.framing`: magic, msgpack header, payload, CRC32), one connection per
(epoch, source, destination) pair *and class*, each with IP_TOS = `tos_for_dscp(dscp)` set before connect
(the handshake carries the class too):
- hello: an END frame, flow id `kvmig-e<epoch>-w<src>-w<dst>`, `block_ids` = (epoch, src, dst, dscp, token),
  no bytes. `token` is the receiver's secret (63 random bits drawn at its start, told to the node world's
  members only, in their exchange at boot): whoever merely reaches the port cannot write into a cache. The
  receiver checks the token and the epoch it serves, marks its end of the connection with the same
  class (its acks and errors travel in the class of the bytes they answer) and answers ACK, or ERROR and
  closes. The pair's first connection is opened by the source in prepare, in the delta's class
  `STAGE_M_DSCP`, and the source waits for that ACK inside prepare: a pair that cannot connect refuses the
  prepare on every member.
- a chunk: a DATA frame (offset 0, the chunk's K/V bytes in the layout
  [layers, K/V, blocks, block_size, heads, head_dim]) then an END frame with `total_bytes` and, in
  `block_ids`, the placement: (layer_start, layer_end, head_start, head_end, *destination block ids), so
  the receiver needs nothing but its cache. ACK (`total_bytes`) once written; ERROR on any mismatch.

Blocking sockets, not the async TcpTransferSender/Receiver: the source side runs in the step thread, which
is synchronous and must know a chunk landed before it returns (pre-copy between two decode steps, the delta
inside the pause); an event-loop thread would add a thread hop per chunk and a loop to own and stop, for
nothing. The receiver needs one thread per epoch anyway (its worker's step thread is busy with its own old
group's steps while sources write): a `selectors` loop over the listening socket and the epoch's
connections. The async classes also buffer a flow whole before a sink sees it; here a chunk is one frame.

Classes (ALGORITHMS.md §2.4: each level maps to a DSCP; KV bytes across hosts go over TCP connections whose
IP_TOS carries it, one connection per class):
- pre-copy: a stage-M flow's chunks go in the class of the level its flow-scheduler permit grants
  (services/worker/migration_flows.py maps the level through the agent's DSCP table; the step thread gets
  the DSCP with the chunks, `NodeCommand.classes`). A flow run without a permit (scheduler silent or
  pruning) goes at the lowest level's, `LOWEST_DSCP` (LE), like every unpermitted flow.
- the commit's delta, and any pre-copy chunk still left at commit: copied inside the commit, not under a
  permit, on the critical path of the cutover (streams are paused): the highest class used for urgent
  stage-M traffic, `STAGE_M_DSCP` = P1 of DSCP_TABLE (EF).
The choice: one connection per class per pair, as `nitsum.transfer.tcp.TcpTransferSender` does (DSCP ->
connection, TOS set before connect), the delta's opened in prepare (it doubles as the reachability check),
every other class lazily at its first chunk (a connect and a hello written from the step thread; the hello's
ack is read with the chunk's). Re-marking the pair's single connection (setsockopt IP_TOS between classes)
was not taken: a pair carries one pre-copy flow per epoch, but also the delta, in another class; Linux
reads a socket's TOS at transmit time, so re-marking would re-class whatever TCP still holds queued or
retransmits, the receiver would need an in-band re-mark to keep its acks in step, and a switch could not be
observed on the wire by the receiver (it sees the class of the handshake). Separate connections keep each
class's bytes on its own queue; it costs one connection per class a pair actually uses (normally two).
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from nitsum.kv.reshard import Transfer
from nitsum.policy.flows import DSCP_LE, DSCP_TABLE, tos_for_dscp
from nitsum.transfer.framing import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX,
    ErrorCode,
    FrameHeader,
    FrameKind,
    TransferError,
    decode_body,
    decode_prefix,
    encode_frame,
)

# The commit's delta (and chunks left to the commit): inside the pause, the urgent explicit class P1.
STAGE_M_LEVEL = 1
STAGE_M_DSCP = DSCP_TABLE[STAGE_M_LEVEL]
# A pre-copy chunk whose flow has no permit class: the lowest level's (every dscp_table(K) maps level K to LE).
LOWEST_DSCP = DSCP_LE
# Connect + hello, and then one frame or one ack: below the node world's collective timeout (30 s by default),
# so that a stuck link fails as a link (the span refuses the epoch) before the span's exchange times out.
CONNECT_TIMEOUT_S = 10.0
# A class opened at its first chunk, from the old group's step thread: the peer already answered in prepare (in
# the delta's class), so a slow connect here is the path refusing this class -- it must not stall decoding for
# long; the flow then fails and the prepare is refused (the old topology keeps serving).
LAZY_CONNECT_TIMEOUT_S = 2.0
IO_TIMEOUT_S = 10.0
# A receiver's limits for connections that have not said their hello yet (anyone who reaches the port).
HELLO_MAX_HEADER_BYTES = 1024
MAX_CONNECTIONS = 256
ERROR_PEEK_S = 0.5  # after a failed write: how long to look for the receiver's ERROR that explains it
MAX_ERRORS = 256  # what a receiver keeps of its refusals (each is logged too)
THREAD_PREFIX = "nitsum-kv-recv"

log = logging.getLogger("nitsum.kv")


def flow_id(epoch: int, src: int, dst: int) -> str:
    return f"kvmig-e{epoch}-w{src}-w{dst}"


# -- frames on a blocking socket ------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError(ErrorCode.CLOSED, "connection closed by the peer")
        got += k
    return buf


def read_frame(
    sock: socket.socket, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> tuple[FrameHeader, bytearray]:
    try:
        hdr_len, payload_len, crc = decode_prefix(bytes(_recv_exact(sock, PREFIX.size)), max_payload_bytes)
        hdr = bytes(_recv_exact(sock, hdr_len))
        payload = _recv_exact(sock, payload_len) if payload_len else bytearray()
    except TimeoutError as exc:
        raise TransferError(ErrorCode.TIMEOUT, f"no frame within {sock.gettimeout()} s") from exc
    except (ConnectionError, OSError) as exc:
        raise TransferError(ErrorCode.CLOSED, repr(exc)) from exc
    return decode_body(hdr, payload, crc), payload


def write_frame(sock: socket.socket, header: FrameHeader, payload: bytes | memoryview = b"") -> None:
    try:
        for buf in encode_frame(header, payload):
            sock.sendall(buf)
    except TimeoutError as exc:
        raise TransferError(ErrorCode.TIMEOUT, "send stalled", header.flow_id) from exc
    except (ConnectionError, OSError) as exc:
        raise TransferError(ErrorCode.CLOSED, repr(exc), header.flow_id) from exc


def tos_of(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)


_IP_PKTOPTIONS = getattr(socket, "IP_PKTOPTIONS", 9)  # Linux
_CMSG_HEADER = struct.Struct("@Nii")  # cmsg_len, cmsg_level, cmsg_type


def handshake_tos(sock: socket.socket) -> int | None:
    """The TOS byte an accepted TCP connection's handshake arrived with, i.e. the class the peer set before
    connecting, as seen on the wire (Linux keeps it for IP_PKTOPTIONS once IP_RECVTOS is on); None where the
    platform does not tell."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        raw = sock.getsockopt(socket.IPPROTO_IP, _IP_PKTOPTIONS, 256)
    except OSError:
        return None
    offset, align = 0, struct.calcsize("@N")
    while offset + _CMSG_HEADER.size <= len(raw):
        length, level, kind = _CMSG_HEADER.unpack_from(raw, offset)
        if length < _CMSG_HEADER.size:
            return None
        data = raw[offset + _CMSG_HEADER.size : offset + length]
        if level == socket.IPPROTO_IP and kind == socket.IP_TOS and data:
            return struct.unpack("@i", data)[0] & 0xFF if len(data) >= 4 else data[0]
        offset += (length + align - 1) // align * align
    return None


def open_kv_sockets(receiver_port: int, peer_ports: Iterable[int]) -> int:
    """TCP sockets this process holds open on the KV data plane (Linux: its descriptors matched against
    /proc/net/tcp): connections accepted on `receiver_port` and links to the peers' receiver ports. The
    listening socket itself is not counted. A leak check that does not trust this module's bookkeeping."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    peers = set(peer_ports) - {0}
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if inode not in inodes or state == "0A":  # not ours, or LISTEN
                continue
            if int(local.split(":")[1], 16) == receiver_port or int(remote.split(":")[1], 16) in peers:
                count += 1
    return count


# -- the destination side ---------------------------------------------------------------------------------
def write_blocks(cache: torch.Tensor, heads: tuple[int, int], placement: tuple[int, ...], payload: bytearray) -> None:
    """One received chunk into this worker's new cache; TransferError(PROTOCOL) when it does not fit."""
    if len(placement) < 5:
        raise TransferError(ErrorCode.PROTOCOL, f"placement {placement[:8]} names no block")
    l0, l1, h0, h1, *ids = placement
    layers, _, num_blocks, block_size, _, head_dim = cache.shape
    if not (0 <= l0 < l1 <= layers and heads[0] <= h0 < h1 <= heads[1]):
        raise TransferError(
            ErrorCode.PROTOCOL,
            f"layers [{l0}, {l1}) / heads [{h0}, {h1}) outside this cache ({layers} layers, heads {list(heads)})",
        )
    if not all(0 <= b < num_blocks for b in ids):
        raise TransferError(ErrorCode.PROTOCOL, f"a block id outside [0, {num_blocks})")
    shape = (l1 - l0, 2, len(ids), block_size, h1 - h0, head_dim)
    if len(payload) != math.prod(shape) * cache.element_size():
        raise TransferError(ErrorCode.PROTOCOL, f"{len(payload)} bytes for a chunk of shape {shape}")
    src = torch.frombuffer(payload, dtype=cache.dtype).view(shape)
    index = torch.tensor(ids, dtype=torch.long)
    cache[l0:l1, :, index, :, h0 - heads[0] : h1 - heads[0]] = src


@dataclass
class _Conn:
    sock: socket.socket
    src: int | None = None  # known after the hello
    dscp: int | None = None  # the class its hello names (this end's acks go in it too)
    wire_tos: int | None = None  # the TOS its handshake arrived with (`handshake_tos`), where known
    data: bytearray | None = None  # a DATA frame waiting for its END
    buf: bytearray = field(default_factory=bytearray)  # bytes received, not yet a whole frame
    since: float | None = None  # monotonic time the oldest partial frame began (its deadline: + IO_TIMEOUT_S)
    refused: bool = False  # an ERROR went out: what still comes is read and dropped until the source closes
    # (or IO_TIMEOUT_S after the ERROR: a peer that reads nothing and never closes does not keep its socket)
    refused_at: float | None = None


@dataclass
class _Session:
    epoch: int
    me: int
    cache: torch.Tensor
    heads: tuple[int, int]
    sources: frozenset[int]
    conns: list[_Conn] = field(default_factory=list)
    thread: threading.Thread | None = None
    wake: tuple[socket.socket, socket.socket] | None = None
    stop: bool = False


class KvReceiver:
    """This worker's KV receiver: a listening socket for the runtime's life (its port is advertised once,
    at construction), serving one epoch's connections at a time while that epoch is prepared."""

    def __init__(self, bind_addr: str, fault_epoch: int = 0, fault_chunk_epochs: Iterable[int] = ()) -> None:
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind((bind_addr, 0))
        self._listen.listen(64)
        self._listen.setblocking(False)
        self.port = self._listen.getsockname()[1]
        self.token = int.from_bytes(os.urandom(8), "big") >> 1  # the hello's secret (a msgpack int); never logged
        self.fault_epoch = fault_epoch  # tests: close every connection of this epoch unanswered
        self.fault_chunk_epochs = frozenset(fault_chunk_epochs)  # tests: refuse their chunks (after the hello)
        self.errors: list[str] = []  # what this end refused or lost (logs, tests)
        self.bytes_written = 0
        # bytes_written by the TOS their connection arrived with (its handshake's, as seen here; where the
        # platform does not tell, the class its hello names): which class carried what, from the wire's side
        self.bytes_by_tos: dict[int, int] = {}
        self._session: _Session | None = None

    @property
    def serving(self) -> int | None:
        """The epoch whose connections are being served, if any."""
        return self._session.epoch if self._session is not None else None

    @property
    def open_connections(self) -> int:
        s = self._session
        return sum(1 for c in s.conns if c.sock.fileno() >= 0) if s is not None else 0

    def open(self, epoch: int, me: int, cache: torch.Tensor, heads: tuple[int, int], sources: Iterable[int]) -> None:
        """Serve `epoch`'s sources (writing into `cache`, whose global KV heads are `heads`) until `close_session`."""
        self.close_session()
        session = _Session(epoch, me, cache, heads, frozenset(sources))
        session.wake = socket.socketpair()
        session.thread = threading.Thread(
            target=self._serve, args=(session,), name=f"{THREAD_PREFIX}-e{epoch}-w{me}", daemon=True
        )
        self._session = session
        session.thread.start()

    def close_session(self) -> None:
        """Stop serving: the thread ends, every connection of the epoch closes (idempotent)."""
        session, self._session = self._session, None
        if session is None:
            return
        session.stop = True
        assert session.wake is not None and session.thread is not None
        try:
            session.wake[1].send(b"x")
        except OSError:
            pass
        for conn in list(session.conns):  # a read waiting for a stalled source returns at once
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the thread
        session.thread.join()
        for s in session.wake:
            s.close()

    def close(self) -> None:
        self.close_session()
        self._listen.close()

    # -- the epoch's thread -------------------------------------------------------------------------
    def _serve(self, session: _Session) -> None:
        assert session.wake is not None
        sel = selectors.DefaultSelector()
        sel.register(self._listen, selectors.EVENT_READ, "listen")
        sel.register(session.wake[0], selectors.EVENT_READ, "wake")
        try:
            while not session.stop:
                for key, _ in sel.select(timeout=0.5):
                    if key.data == "wake":
                        return
                    if key.data == "listen":
                        self._accept(session, sel)
                    elif not self._serve_readable(session, key.data):
                        sel.unregister(key.fileobj)
                        key.data.sock.close()
                        session.conns.remove(key.data)  # done: no deadline of its own, no place in the cap
                now = time.monotonic()
                for conn in [
                    c
                    for c in session.conns
                    if c.since is not None and now - c.since > IO_TIMEOUT_S and c.sock.fileno() >= 0
                ]:
                    # A source that stalls mid-frame fails alone; the others' frames are served meanwhile. (So
                    # does a connection that sends no hello at all: its deadline runs from its accept.)
                    self._refuse(
                        session,
                        conn,
                        TransferError(
                            ErrorCode.TIMEOUT, f"no whole frame within {IO_TIMEOUT_S} s", self._fid(session, conn)
                        ),
                    )
                for conn in [
                    c for c in session.conns if c.refused_at is not None and now - c.refused_at > IO_TIMEOUT_S
                ]:
                    if conn.sock.fileno() >= 0:
                        sel.unregister(conn.sock)
                        conn.sock.close()
                    session.conns.remove(conn)
        finally:
            sel.close()
            for conn in session.conns:
                conn.sock.close()

    def _accept(self, session: _Session, sel: selectors.BaseSelector) -> None:
        try:
            sock, _ = self._listen.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(session.conns) >= MAX_CONNECTIONS:  # (a session's sources need a few per class)
            self._record(f"epoch {session.epoch}: more than {MAX_CONNECTIONS} connections; one closed unanswered")
            sock.close()
            return
        sock.setblocking(False)  # read what is there; frames are cut from the connection's own buffer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Its hello is due within IO_TIMEOUT_S, as any frame once begun (`since`).
        conn = _Conn(sock, wire_tos=handshake_tos(sock), since=time.monotonic())  # class: set at the hello
        session.conns.append(conn)
        sel.register(sock, selectors.EVENT_READ, conn)

    @staticmethod
    def _fid(session: _Session, conn: _Conn) -> str:
        return flow_id(session.epoch, conn.src if conn.src is not None else -1, session.me)

    def _serve_readable(self, session: _Session, conn: _Conn) -> bool:
        """Take what the connection has, serve every whole frame in it; False when it is done (closed,
        failed). Never waits for more bytes: one slow source cannot hold the others' frames."""
        try:
            while True:
                # Before its hello a connection gets no more than a hello's worth read at a time (the rest waits
                # in the socket, and select says so again once the hello is served).
                size = PREFIX.size + HELLO_MAX_HEADER_BYTES if conn.src is None and not conn.refused else 1 << 20
                try:
                    got = conn.sock.recv(size)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    raise TransferError(ErrorCode.CLOSED, repr(exc), self._fid(session, conn)) from exc
                if not got:
                    if conn.buf or conn.data is not None:  # (a source closing its link between frames is normal)
                        self._record(f"{self._fid(session, conn)}: closed by the source mid-chunk")
                    return False
                if conn.refused:
                    continue  # drained, so the source's writes complete and it reads the ERROR sent before
                conn.buf += got
                if len(got) < size or size < 1 << 20:
                    break
            while not conn.refused:
                frame = self._cut_frame(conn)
                if frame is None:
                    break
                if not self._serve_frame(session, conn, *frame):
                    return False
            if conn.src is not None or conn.refused:  # (before its hello, the deadline set at accept stands)
                conn.since = (conn.since or time.monotonic()) if conn.buf and not conn.refused else None
            return True
        except TransferError as exc:  # a torn or corrupt frame (bad magic, CRC, size) or a lost connection
            if exc.code is ErrorCode.CLOSED:
                self._record(f"{exc.flow_id or self._fid(session, conn)}: {exc}")
                return False
            return self._refuse(session, conn, exc)
        except Exception as exc:  # noqa: BLE001 -- a bug here must fail the link loudly, not kill the thread
            return self._refuse(
                session, conn, TransferError(ErrorCode.SINK, f"{type(exc).__name__}: {exc}", self._fid(session, conn))
            )

    @staticmethod
    def _cut_frame(conn: _Conn) -> tuple[FrameHeader, bytearray] | None:
        """The next whole frame of the connection's buffer, or None until more bytes arrive. Before the hello
        (which has no payload and a small header) nothing larger is buffered: whoever merely reaches the port
        cannot make this receiver hold a chunk's worth of memory."""
        buf = conn.buf
        if len(buf) < PREFIX.size:
            return None
        hello = conn.src is None
        hdr_len, payload_len, crc = decode_prefix(bytes(buf[: PREFIX.size]), 0 if hello else DEFAULT_MAX_PAYLOAD_BYTES)
        if hello and hdr_len > HELLO_MAX_HEADER_BYTES:
            raise TransferError(
                ErrorCode.PROTOCOL, f"a hello of {hdr_len} header bytes (at most {HELLO_MAX_HEADER_BYTES})"
            )
        end = PREFIX.size + hdr_len + payload_len
        if len(buf) < end:
            return None
        hdr = bytes(buf[PREFIX.size : PREFIX.size + hdr_len])
        payload = buf[PREFIX.size + hdr_len : end]
        del buf[:end]
        conn.since = None
        return decode_body(hdr, payload, crc), payload

    def _serve_frame(self, session: _Session, conn: _Conn, header: FrameHeader, payload: bytearray) -> bool:
        """Apply one frame; False when the connection is done (closed unanswered)."""
        fid = header.flow_id
        try:
            if conn.src is None:
                return self._hello(session, conn, header)
            if header.kind is FrameKind.DATA:
                if header.offset != 0 or conn.data is not None:
                    raise TransferError(ErrorCode.PROTOCOL, "a chunk is one DATA frame then its END", fid)
                conn.data = payload
                return True
            if header.kind is FrameKind.END:
                data, conn.data = conn.data if conn.data is not None else bytearray(), None
                if len(data) != header.total_bytes:
                    raise TransferError(ErrorCode.PROTOCOL, f"got {len(data)} of {header.total_bytes} bytes", fid)
                if session.epoch in self.fault_chunk_epochs:
                    raise TransferError(ErrorCode.SINK, "injected chunk failure", fid)
                write_blocks(session.cache, session.heads, header.block_ids, data)
                self.bytes_written += len(data)
                tos = conn.wire_tos if conn.wire_tos is not None else tos_for_dscp(conn.dscp or 0)
                self.bytes_by_tos[tos] = self.bytes_by_tos.get(tos, 0) + len(data)
                self._send(conn, FrameHeader(FrameKind.ACK, fid, total_bytes=len(data)))
                return True
            if header.kind is FrameKind.ERROR:
                self._record(f"{fid}: the source gave up: {header.code}: {header.message}")
                return False
            raise TransferError(ErrorCode.PROTOCOL, f"unexpected {header.kind.value} frame at the receiver", fid)
        except TransferError as exc:
            if exc.code is ErrorCode.CLOSED:
                self._record(f"{fid}: {exc}")
                return False
            return self._refuse(session, conn, exc)

    def _refuse(self, session: _Session, conn: _Conn, exc: TransferError) -> bool:
        """Tell the source why (ERROR), then keep reading and dropping what it still sends until it closes:
        closing at once would reset the connection under its pending writes, and a reset discards the ERROR
        before the source reads it (it would see only "broken pipe")."""
        self._record(f"{exc.flow_id or self._fid(session, conn)}: {exc}")
        conn.refused, conn.data, conn.since, conn.refused_at = True, None, None, time.monotonic()
        conn.buf.clear()
        try:
            self._send(
                conn,
                FrameHeader(
                    FrameKind.ERROR, exc.flow_id or self._fid(session, conn), code=exc.code.value, message=exc.message
                ),
            )
        except TransferError:
            return False  # the source is gone; its own read fails
        return True

    @staticmethod
    def _send(conn: _Conn, header: FrameHeader) -> None:
        """A small frame (ack, error) on the non-blocking connection: it fits the socket buffer, except when
        the source reads nothing -- then, bounded, it fails as a stall."""
        try:
            conn.sock.settimeout(IO_TIMEOUT_S)
            try:
                write_frame(conn.sock, header)
            finally:
                conn.sock.setblocking(False)
        except OSError as exc:  # closed under it (the peer went): the caller's refusal path, never the thread's end
            raise TransferError(ErrorCode.CLOSED, repr(exc), header.flow_id) from exc

    def _record(self, what: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(what)
        log.warning("KV receiver: %s", what)

    def _hello(self, session: _Session, conn: _Conn, header: FrameHeader) -> bool:
        ids = header.block_ids
        if header.kind is not FrameKind.END or len(ids) != 5 or not 0 <= ids[3] < 64:
            raise TransferError(ErrorCode.PROTOCOL, "the first frame must be the pair's hello", header.flow_id)
        epoch, src, dst, dscp, token = ids
        if not 0 <= token < 2**63 or not hmac.compare_digest(token.to_bytes(8, "big"), self.token.to_bytes(8, "big")):
            raise TransferError(
                ErrorCode.PROTOCOL,
                "the hello's token is not this receiver's (only members of its node world know it)",
                header.flow_id,
            )
        if epoch != session.epoch or dst != session.me or src not in session.sources:
            raise TransferError(
                ErrorCode.PROTOCOL,
                f"hello for epoch {epoch}, w{src} -> w{dst}: this receiver "
                f"serves epoch {session.epoch} of w{session.me} from {sorted(session.sources)}",
                header.flow_id,
            )
        if epoch == self.fault_epoch:
            self._record(f"{header.flow_id}: injected connection failure")
            return False  # closed unanswered: the source's hello fails as a lost connection
        conn.src, conn.dscp = src, dscp
        conn.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_for_dscp(dscp))  # acks go in the class too
        self._send(conn, FrameHeader(FrameKind.ACK, header.flow_id))
        return True


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
        timeout_s: float = CONNECT_TIMEOUT_S,
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
            conn = self._open(dscp, LAZY_CONNECT_TIMEOUT_S)
            conn.sock.settimeout(IO_TIMEOUT_S)
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
            conn.sock.settimeout(ERROR_PEEK_S)
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
                conn.sock.settimeout(IO_TIMEOUT_S)
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
        deadline = time.monotonic() + CONNECT_TIMEOUT_S  # one budget for all: unreachable peers do not add up
        for dst, (addr, port, token) in sorted(targets.items()):
            self.links[dst] = KvLink(
                epoch, src, dst, addr, port, token, dscp, deadline - time.monotonic(), self.on_open
            )
        for link in self.links.values():
            link.wait(deadline)
            link.sock.settimeout(IO_TIMEOUT_S)

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
