"""KV data plane: framing, TCP per class with DSCP, shared memory; failures reach both ends."""

from __future__ import annotations

import asyncio
import socket
import struct

import msgpack
import pytest

from nitsum.policy.flows import DSCP_TABLE
from nitsum.transfer.framing import (
    PREFIX,
    ErrorCode,
    FrameHeader,
    FrameKind,
    TransferError,
    as_buffer,
    decode_frame,
    encode_frame,
)
from nitsum.transfer.shm import SEGMENT_PREFIX, ShmHandle, ShmPublisher, receive
from nitsum.transfer.tcp import MemorySink, TcpTransferReceiver, TcpTransferSender


def whole(header: FrameHeader, payload: bytes = b"") -> bytes:
    return b"".join(bytes(b) for b in encode_frame(header, payload))


def test_frame_round_trip() -> None:
    h = FrameHeader(FrameKind.END, "f1", total_bytes=7, block_ids=(3, 4))
    assert decode_frame(whole(h, b"payload")) == (h, b"payload")


def test_corrupt_payload_is_a_checksum_error_naming_the_flow() -> None:
    raw = bytearray(whole(FrameHeader(FrameKind.DATA, "f1"), b"abcdef"))
    raw[-1] ^= 0xFF
    with pytest.raises(TransferError) as err:
        decode_frame(bytes(raw))
    assert (err.value.code, err.value.flow_id) == (ErrorCode.CHECKSUM, "f1")


def test_size_limits_and_unknown_kinds_are_rejected() -> None:
    with pytest.raises(TransferError) as err:
        decode_frame(whole(FrameHeader(FrameKind.DATA, "f"), b"x" * 100), max_payload_bytes=99)
    assert err.value.code is ErrorCode.TOO_LARGE
    hdr = msgpack.packb({"k": "teleport", "f": "f", "o": 0, "t": 0, "b": [], "c": "", "m": "", "v": 1})
    import zlib

    raw = PREFIX.pack(b"NKV1", len(hdr), 0, zlib.crc32(hdr)) + hdr
    with pytest.raises(TransferError) as err:
        decode_frame(raw)
    assert err.value.code is ErrorCode.PROTOCOL
    with pytest.raises(TransferError, match="bad magic"):
        decode_frame(struct.pack("!4sIQI", b"HTTP", 0, 0, 0))


def test_as_buffer_accepts_bytes_like_and_tensor_like() -> None:
    class FakeTensor:
        def contiguous(self) -> FakeTensor:
            return self

        def numpy(self) -> bytearray:
            return bytearray(b"\x01\x02")

    assert bytes(as_buffer(b"ab")) == b"ab"
    assert bytes(as_buffer(FakeTensor())) == b"\x01\x02"
    with pytest.raises(TypeError):
        as_buffer(42)


async def test_tcp_flows_arrive_whole_one_connection_per_class_with_dscp_in_ip_tos() -> None:
    sink = MemorySink()
    rx = TcpTransferReceiver(sink)
    port = await rx.start()
    tx = TcpTransferSender("127.0.0.1", port, chunk_bytes=1000)
    try:
        payload = bytes(range(256)) * 40  # 10 240 bytes → 11 DATA frames
        await asyncio.gather(
            tx.send("urgent", payload, level=1, block_ids=(7,)),
            tx.send("bulk", payload[::-1], level=8),
            tx.send("bulk2", b"", level=8),
        )
        assert sink.flows == {"urgent": payload, "bulk": payload[::-1], "bulk2": b""}
        s1, s8 = tx.socket_for(1), tx.socket_for(8)
        assert s1 is not None and s8 is not None and s1 is not s8
        assert s1.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == DSCP_TABLE[1] << 2 == 184
        assert s8.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == DSCP_TABLE[8] << 2 == 4
        assert tx.socket_for(2) is None
        assert rx.errors == [] and sink.released == []
    finally:
        await tx.close()
        await rx.close()


async def test_a_receiver_that_admits_refuses_a_strangers_flow_at_its_first_frame() -> None:
    """`admit` sees the first DATA frame's block ids (the sender puts them there as well as on END): a flow
    without the expected ones is refused before its bytes are buffered. Shown by the order of the checks: the
    stranger's flow is larger than the receiver takes, and still the refusal is the token's, not TOO_LARGE."""
    sink = MemorySink()
    rx = TcpTransferReceiver(sink, max_flow_bytes=2000)
    seen: list[tuple[str, tuple[int, ...]]] = []

    def admit(flow_id: str, block_ids: tuple[int, ...]) -> None:
        seen.append((flow_id, block_ids))
        if block_ids != (42,):
            raise TransferError(ErrorCode.SINK, "not this receiver's token", flow_id)

    rx.admit = admit
    port = await rx.start()
    tx = TcpTransferSender("127.0.0.1", port, chunk_bytes=1000)
    try:
        with pytest.raises(TransferError):
            await tx.send("stranger", b"z" * 10_000, level=3, block_ids=(41,))
        assert [e.code for e in rx.errors] == [ErrorCode.SINK] and "token" in rx.errors[0].message
        await tx.send("friend", b"k" * 1500, level=3, block_ids=(42,))
        assert sink.flows == {"friend": b"k" * 1500}
        assert seen == [("stranger", (41,)), ("friend", (42,))]  # once per flow, at its first frame
    finally:
        await tx.close()
        await rx.close()


async def test_corrupted_frame_fails_the_flow_at_both_ends_and_releases_its_blocks() -> None:
    sink = MemorySink()
    rx = TcpTransferReceiver(sink)
    port = await rx.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(whole(FrameHeader(FrameKind.DATA, "f1", offset=0), b"good"))
        bad = bytearray(whole(FrameHeader(FrameKind.DATA, "f1", offset=4), b"evil"))
        bad[-2] ^= 0x01
        writer.write(bytes(bad))
        await writer.drain()
        prefix = await asyncio.wait_for(reader.readexactly(PREFIX.size), 5)
        _, hdr_len, payload_len, _ = PREFIX.unpack(prefix)
        reply, _ = decode_frame(prefix + await reader.readexactly(hdr_len + payload_len))
        assert (reply.kind, reply.flow_id, reply.code) == (FrameKind.ERROR, "f1", "checksum")
        assert [(e.code, e.flow_id) for e in rx.errors] == [(ErrorCode.CHECKSUM, "f1")]
        assert sink.released == ["f1"] and sink.flows == {}
    finally:
        writer.close()
        await rx.close()


async def test_sink_refusal_reaches_the_sender_as_a_typed_error() -> None:
    class Full(MemorySink):
        def commit(self, flow_id: str, block_ids: tuple[int, ...], data: bytes) -> None:
            if flow_id == "f":
                raise TransferError(ErrorCode.SINK, "no free blocks", flow_id)
            super().commit(flow_id, block_ids, data)

    sink = Full()
    rx = TcpTransferReceiver(sink)
    port = await rx.start()
    tx = TcpTransferSender("127.0.0.1", port)
    try:
        with pytest.raises(TransferError) as err:
            await tx.send("f", b"kv" * 10, level=3)
        assert err.value.code is ErrorCode.PEER and "no free blocks" in err.value.message
        assert sink.released == ["f"]
        await tx.send("g-after", b"ok", level=3)  # the class connection survives a failed flow
        assert sink.flows == {"g-after": b"ok"}
    finally:
        await tx.close()
        await rx.close()


async def test_sender_abort_makes_the_receiver_release() -> None:
    sink = MemorySink()
    rx = TcpTransferReceiver(sink)
    port = await rx.start()
    tx = TcpTransferSender("127.0.0.1", port)
    try:
        await tx.abort("f9", level=2, message="source blocks evicted")
        for _ in range(100):
            if sink.released:
                break
            await asyncio.sleep(0.01)
        assert sink.released == ["f9"]
        assert rx.errors[0].code is ErrorCode.PEER
    finally:
        await tx.close()
        await rx.close()


async def test_connect_failure_is_a_transfer_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        tx = TcpTransferSender("127.0.0.1", port, timeout_s=2.0)
        with pytest.raises(TransferError) as err:
            await tx.send("f", b"x", level=1)
        assert err.value.code is ErrorCode.CLOSED


def test_shm_publish_receive_release() -> None:
    pub = ShmPublisher()
    try:
        h = pub.publish("f1", b"kv-bytes" * 100, block_ids=(1, 2))
        assert h.segment.startswith(SEGMENT_PREFIX)
        assert ShmHandle.from_wire(msgpack.unpackb(msgpack.packb(h.to_wire()))) == h
        assert receive(h) == b"kv-bytes" * 100
        assert pub.live_segments() == [h.segment]
        pub.release(h)
        pub.release(h)  # idempotent
        assert pub.live_segments() == []
        with pytest.raises(TransferError) as err:
            receive(h)
        assert err.value.code is ErrorCode.CLOSED
    finally:
        pub.close()


def test_shm_checksum_mismatch_and_bad_handles() -> None:
    pub = ShmPublisher()
    try:
        h = pub.publish("f1", b"abc")
        forged = ShmHandle(h.flow_id, h.segment, h.size_bytes, h.crc32 ^ 1)
        with pytest.raises(TransferError) as err:
            receive(forged)
        assert err.value.code is ErrorCode.CHECKSUM
        with pytest.raises(TransferError):
            receive(ShmHandle("f", "etc_passwd", 1, 0))
        with pytest.raises(TransferError):
            receive(ShmHandle(h.flow_id, h.segment, 1 << 20, h.crc32))
        assert receive(pub.publish("empty", b"")) == b""
    finally:
        pub.close()
    assert pub.live_segments() == []
