"""The destination side of the KV TCP plane (`nitsum.transfer.kv_tcp` describes the protocol): one listening
socket per worker for the runtime's life, serving one epoch's connections at a time on a `selectors` thread,
writing each chunk into the new cache and acking it after the write."""

from __future__ import annotations

import hmac
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from nitsum.policy.flows import tos_for_dscp
from nitsum.transfer import kv_tcp
from nitsum.transfer.framing import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX,
    ErrorCode,
    FrameHeader,
    FrameKind,
    TransferError,
    decode_body,
    decode_prefix,
)
from nitsum.transfer.kv_tcp import THREAD_PREFIX, flow_id, handshake_tos, write_frame

log = logging.getLogger("nitsum.kv")


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
                    if c.since is not None and now - c.since > kv_tcp.IO_TIMEOUT_S and c.sock.fileno() >= 0
                ]:
                    # A source that stalls mid-frame fails alone; the others' frames are served meanwhile. (So
                    # does a connection that sends no hello at all: its deadline runs from its accept.)
                    self._refuse(
                        session,
                        conn,
                        TransferError(
                            ErrorCode.TIMEOUT,
                            f"no whole frame within {kv_tcp.IO_TIMEOUT_S} s",
                            self._fid(session, conn),
                        ),
                    )
                for conn in [
                    c for c in session.conns if c.refused_at is not None and now - c.refused_at > kv_tcp.IO_TIMEOUT_S
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
        if len(session.conns) >= kv_tcp.MAX_CONNECTIONS:  # (a session's sources need a few per class)
            self._record(
                f"epoch {session.epoch}: more than {kv_tcp.MAX_CONNECTIONS} connections; one closed unanswered"
            )
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
                size = PREFIX.size + kv_tcp.HELLO_MAX_HEADER_BYTES if conn.src is None and not conn.refused else 1 << 20
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
        if hello and hdr_len > kv_tcp.HELLO_MAX_HEADER_BYTES:
            raise TransferError(
                ErrorCode.PROTOCOL, f"a hello of {hdr_len} header bytes (at most {kv_tcp.HELLO_MAX_HEADER_BYTES})"
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
                kv_tcp.write_blocks(session.cache, session.heads, header.block_ids, data)
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
            conn.sock.settimeout(kv_tcp.IO_TIMEOUT_S)
            try:
                write_frame(conn.sock, header)
            finally:
                conn.sock.setblocking(False)
        except OSError as exc:  # closed under it (the peer went): the caller's refusal path, never the thread's end
            raise TransferError(ErrorCode.CLOSED, repr(exc), header.flow_id) from exc

    def _record(self, what: str) -> None:
        if len(self.errors) < kv_tcp.MAX_ERRORS:
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
