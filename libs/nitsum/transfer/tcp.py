"""The TCP data plane's asyncio driver: P/D hand-offs and stage-1 KV reuse between hosts (services/worker/kv_net.py)
and the namespace testbed's flows (`nitsum.bench.testbed`, `nitsum bench flows`, tests/net). One connection per
priority class, each tagged IP_TOS = DSCP << 2 (`handshake_tos`, shared with the synchronous driver of TP changes,
`nitsum.transfer.kv_tcp`: one wire format, `framing`, two drivers, one for the event loop and one for the step
thread), with optional pacing.

Async shell over `framing`. A flow is DATA frames then END; the receiver answers ACK once its sink
committed the blocks, or ERROR (and releases whatever it reserved). A sender-side failure mid-flow sends
ERROR so the receiver releases too; `send` raises `TransferError` either way, and the caller releases its
own source blocks (`try: await send(...) finally: unpin`). Flows of one class share that class's
connection (frames carry the flow id), so a class never reorders bytes the way per-packet promotion would.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from nitsum.policy.flows import DSCP_TABLE, tos_for_dscp
from nitsum.transfer.framing import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX,
    ErrorCode,
    FrameHeader,
    FrameKind,
    TransferError,
    as_buffer,
    decode_body,
    decode_prefix,
    encode_frame,
)
from nitsum.transfer.kv_tcp import handshake_tos

DEFAULT_CHUNK_BYTES = 256 * 1024


class BlockSink(Protocol):
    """Where received flows land (the KV block pool of the receiving worker)."""

    def commit(self, flow_id: str, block_ids: tuple[int, ...], data: bytes) -> None:
        """Store a whole flow; raise TransferError(SINK) to refuse it."""

    def release(self, flow_id: str) -> None:
        """The flow failed: free anything reserved for it."""


@dataclass
class MemorySink:
    """A BlockSink that keeps flows in a dict (tests, benchmarks)."""

    flows: dict[str, bytes] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    arrivals: list[tuple[str, float]] = field(default_factory=list)  # (flow id, loop time s)

    def commit(self, flow_id: str, block_ids: tuple[int, ...], data: bytes) -> None:
        self.flows[flow_id] = data
        self.arrivals.append((flow_id, asyncio.get_running_loop().time()))

    def release(self, flow_id: str) -> None:
        self.released.append(flow_id)


async def _read_frame(reader: asyncio.StreamReader, max_payload_bytes: int) -> tuple[FrameHeader, bytes]:
    prefix = await reader.readexactly(PREFIX.size)
    hdr_len, payload_len, crc = decode_prefix(prefix, max_payload_bytes)
    hdr = await reader.readexactly(hdr_len)
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return decode_body(hdr, payload, crc), payload


async def _write_frame(writer: asyncio.StreamWriter, header: FrameHeader, payload: bytes | memoryview = b"") -> None:
    writer.writelines(encode_frame(header, payload))
    await writer.drain()


class TcpTransferReceiver:
    def __init__(
        self,
        sink: BlockSink,
        host: str = "127.0.0.1",
        port: int = 0,
        max_flow_bytes: int = 1 << 30,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        self.sink = sink
        self.host = host
        self.port = port
        self.max_flow_bytes = max_flow_bytes
        self.max_payload_bytes = max_payload_bytes
        self.errors: list[TransferError] = []  # every flow this end failed or was told failed
        # told (flow id, the TOS its connection's handshake arrived with or None, bytes) after each commit
        self.on_commit: Callable[[str, int | None, int], None] | None = None
        # checks a flow's first DATA frame's `block_ids` (raises TransferError to refuse it) before any of its
        # bytes are buffered; None: every flow is buffered and only the sink's commit at its END decides
        self.admit: Callable[[str, tuple[int, ...]], None] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # connections being served (closed by `close`)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()  # its _serve ends on the closed stream, not cancelled at the loop's end
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pending: dict[str, bytearray] = {}
        failed: set[str] = set()  # flows already failed here: their frames still in flight are dropped
        sock = writer.get_extra_info("socket")
        tos = handshake_tos(sock) if sock is not None else None  # the class as it arrived on the wire
        self._writers.add(writer)
        try:
            while True:
                try:
                    header, payload = await _read_frame(reader, self.max_payload_bytes)
                except asyncio.IncompleteReadError:
                    for fid in pending:
                        self._fail(TransferError(ErrorCode.CLOSED, "connection ended mid-flow", fid))
                    return
                except TransferError as exc:
                    # The stream is no longer trustworthy: fail every flow on it, tell the sender, close.
                    for fid in sorted(set(pending) | ({exc.flow_id} if exc.flow_id else set())):
                        self._fail(TransferError(exc.code, exc.message, fid))
                        await self._send_error(writer, exc.code, exc.message, fid)
                    return
                if header.flow_id in failed:
                    continue
                if not await self._handle(header, payload, pending, writer, tos):
                    failed.add(header.flow_id)
        finally:
            pending.clear()
            self._writers.discard(writer)
            writer.close()

    async def _handle(
        self,
        header: FrameHeader,
        payload: bytes,
        pending: dict[str, bytearray],
        writer: asyncio.StreamWriter,
        tos: int | None = None,
    ) -> bool:
        """Apply one frame; False when it failed the flow."""
        fid = header.flow_id
        if header.kind is FrameKind.DATA:
            if header.offset == 0 and self.admit is not None and fid not in pending:
                try:
                    self.admit(fid, header.block_ids)
                except TransferError as exc:
                    self._fail(TransferError(ErrorCode.SINK, exc.message, fid))
                    await self._send_error(writer, ErrorCode.SINK, exc.message, fid)
                    return False
            buf = pending.setdefault(fid, bytearray())
            if header.offset != len(buf) or len(buf) + len(payload) > self.max_flow_bytes:
                del pending[fid]
                code = ErrorCode.PROTOCOL if header.offset != len(buf) else ErrorCode.TOO_LARGE
                self._fail(TransferError(code, "bad offset or flow too large", fid))
                await self._send_error(writer, code, "bad offset or flow too large", fid)
                return False
            buf += payload
        elif header.kind is FrameKind.END:
            data = bytes(pending.pop(fid, b""))
            if len(data) != header.total_bytes:
                msg = f"got {len(data)} of {header.total_bytes} bytes"
                self._fail(TransferError(ErrorCode.PROTOCOL, msg, fid))
                await self._send_error(writer, ErrorCode.PROTOCOL, msg, fid)
                return False
            try:
                self.sink.commit(fid, header.block_ids, data)
            except TransferError as exc:
                self._fail(TransferError(ErrorCode.SINK, exc.message, fid))
                await self._send_error(writer, ErrorCode.SINK, exc.message, fid)
                return False
            if self.on_commit is not None:
                self.on_commit(fid, tos, len(data))
            await _write_frame(writer, FrameHeader(FrameKind.ACK, fid, total_bytes=len(data)))
        elif header.kind is FrameKind.ERROR:
            pending.pop(fid, None)
            self._fail(TransferError(ErrorCode.PEER, f"sender failed: {header.code}: {header.message}", fid))
            return False
        else:
            pending.pop(fid, None)
            msg = f"unexpected {header.kind.value} frame at receiver"
            self._fail(TransferError(ErrorCode.PROTOCOL, msg, fid))
            await self._send_error(writer, ErrorCode.PROTOCOL, msg, fid)
            return False
        return True

    def _fail(self, exc: TransferError) -> None:
        self.errors.append(exc)
        self.sink.release(exc.flow_id)

    async def _send_error(self, writer: asyncio.StreamWriter, code: ErrorCode, message: str, fid: str) -> None:
        try:
            await _write_frame(writer, FrameHeader(FrameKind.ERROR, fid, code=code.value, message=message))
        except (ConnectionError, OSError):
            pass  # the sender is gone; its own read fails with CLOSED


class _ClassConnection:
    """One TCP connection for one priority class, with a reader task resolving per-flow futures."""

    def __init__(self, sock: socket.socket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.sock = sock
        self.reader = reader
        self.writer = writer
        self.lock = asyncio.Lock()  # frames of concurrent flows interleave whole, never split
        self.waiting: dict[str, asyncio.Future[FrameHeader]] = {}
        self.task = asyncio.create_task(self._read_replies())

    async def _read_replies(self) -> None:
        error: TransferError
        try:
            while True:
                header, _ = await _read_frame(self.reader, 0)
                fut = self.waiting.pop(header.flow_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(header)
        except asyncio.IncompleteReadError:
            error = TransferError(ErrorCode.CLOSED, "receiver closed the connection")
        except (ConnectionError, OSError) as exc:
            error = TransferError(ErrorCode.CLOSED, repr(exc))
        except TransferError as exc:
            error = exc
        for fid, fut in self.waiting.items():
            if not fut.done():
                fut.set_exception(TransferError(error.code, error.message, fid))
        self.waiting.clear()


class TcpTransferSender:
    """Sends flows to one receiver; the level picks the connection and thereby the DSCP."""

    def __init__(
        self,
        host: str,
        port: int,
        dscp_table: Mapping[int, int] = DSCP_TABLE,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 30.0,
        source_host: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.dscp_table = dict(dscp_table)
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.source_host = source_host
        self._conns: dict[int, _ClassConnection] = {}  # DSCP -> connection
        self._connecting = asyncio.Lock()  # flows of one class arriving together share one new connection

    def socket_for(self, level: int) -> socket.socket | None:
        conn = self._conns.get(self.dscp_table[level])
        return conn.sock if conn else None

    async def _connection(self, level: int) -> _ClassConnection:
        if level not in self.dscp_table:
            raise TransferError(ErrorCode.PROTOCOL, f"no DSCP for level {level}")
        async with self._connecting:
            return await self._connect(self.dscp_table[level])

    async def _connect(self, dscp: int) -> _ClassConnection:
        conn = self._conns.get(dscp)
        if conn is not None and not conn.task.done():
            return conn
        if conn is not None:
            conn.writer.close()  # its reader ended (the receiver closed it): replaced below
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Set before connect so the SYN already carries the class.
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_for_dscp(dscp))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.source_host:
                sock.bind((self.source_host, 0))
            sock.setblocking(False)
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(sock, (self.host, self.port)), self.timeout_s
            )
            reader, writer = await asyncio.open_connection(sock=sock)
        except (TimeoutError, OSError) as exc:
            sock.close()
            raise TransferError(ErrorCode.CLOSED, f"connect to {self.host}:{self.port}: {exc!r}") from exc
        conn = _ClassConnection(sock, reader, writer)
        self._conns[dscp] = conn
        return conn

    async def send(
        self, flow_id: str, payload: object, level: int, block_ids: tuple[int, ...] = (), rate_bps: float | None = None
    ) -> None:
        """Send one flow at `level` and wait for the receiver's ACK; raises TransferError.

        `rate_bps` paces the flow in the sender (Karuna's minimal rate); None sends as fast as TCP allows.
        """
        data = as_buffer(payload)
        conn = await self._connection(level)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[FrameHeader] = loop.create_future()
        if flow_id in conn.waiting:
            raise TransferError(ErrorCode.PROTOCOL, "flow already in flight", flow_id)
        conn.waiting[flow_id] = fut
        start_s = loop.time()
        try:
            for off in range(0, len(data), self.chunk_bytes):
                chunk = data[off : off + self.chunk_bytes]
                async with conn.lock:
                    await asyncio.wait_for(
                        # The first DATA frame carries `block_ids` too, so a receiver that checks them
                        # (`TcpTransferReceiver.admit`) refuses a stranger's flow before buffering it.
                        _write_frame(
                            conn.writer,
                            FrameHeader(FrameKind.DATA, flow_id, offset=off, block_ids=block_ids if off == 0 else ()),
                            chunk,
                        ),
                        self.timeout_s,
                    )
                if fut.done():
                    break  # the receiver already failed the flow
                if rate_bps:
                    ahead_s = start_s + (off + len(chunk)) * 8.0 / rate_bps - loop.time()
                    if ahead_s > 0:
                        await asyncio.sleep(ahead_s)
            if not fut.done():
                async with conn.lock:
                    await asyncio.wait_for(
                        _write_frame(
                            conn.writer, FrameHeader(FrameKind.END, flow_id, total_bytes=len(data), block_ids=block_ids)
                        ),
                        self.timeout_s,
                    )
            reply = await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError as exc:
            await self._abort(conn, flow_id, ErrorCode.TIMEOUT, "no progress within the timeout")
            raise TransferError(ErrorCode.TIMEOUT, f"after {self.timeout_s} s", flow_id) from exc
        except (ConnectionError, OSError) as exc:
            raise TransferError(ErrorCode.CLOSED, repr(exc), flow_id) from exc
        finally:
            conn.waiting.pop(flow_id, None)
        if reply.kind is FrameKind.ERROR:
            raise TransferError(ErrorCode.PEER, f"receiver: {reply.code}: {reply.message}", flow_id)
        if reply.kind is not FrameKind.ACK or reply.total_bytes != len(data):
            raise TransferError(ErrorCode.PROTOCOL, f"unexpected reply {reply.kind.value}", flow_id)

    async def abort(self, flow_id: str, level: int, message: str) -> None:
        """Tell the receiver a flow this end gave up on, so it releases the flow's blocks."""
        await self._abort(await self._connection(level), flow_id, ErrorCode.PEER, message)

    async def _abort(self, conn: _ClassConnection, flow_id: str, code: ErrorCode, message: str) -> None:
        try:
            async with conn.lock:
                await asyncio.wait_for(
                    _write_frame(conn.writer, FrameHeader(FrameKind.ERROR, flow_id, code=code.value, message=message)),
                    self.timeout_s,
                )
        except (TimeoutError, ConnectionError, OSError):
            pass  # the connection is gone: the receiver fails the flow as CLOSED on its own

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.task.cancel()
            conn.writer.close()
            try:
                await conn.writer.wait_closed()
            except (ConnectionError, OSError):
                pass  # already reset by the peer
            try:
                await conn.task
            except asyncio.CancelledError:
                pass
        self._conns.clear()
