"""KV data-plane framing: a fixed prefix, a msgpack header, a payload, one CRC32 over both.

Wire layout of one frame (network byte order):

    magic  b"NKV1"   4 bytes
    header_len       uint32   msgpack-encoded `FrameHeader`
    payload_len      uint64
    crc32            uint32   zlib.crc32 over header bytes then payload bytes
    header bytes, payload bytes

Decoding enforces size limits before reading a body and rejects unknown kinds; a bad checksum is a
`TransferError("checksum")`. No pickle anywhere.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

import msgpack

MAGIC = b"NKV1"
PREFIX = struct.Struct("!4sIQI")
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
SCHEMA_VERSION = 1


class FrameKind(enum.Enum):
    DATA = "data"  # a chunk of a flow's bytes at `offset`
    END = "end"  # the sender has sent every byte: `total_bytes`, `block_ids`
    ACK = "ack"  # receiver → sender: the flow arrived whole and its blocks are committed
    ERROR = "error"  # either direction: the flow failed (`code`, `message`); its blocks are released


class ErrorCode(enum.Enum):
    CHECKSUM = "checksum"
    TOO_LARGE = "too_large"
    PROTOCOL = "protocol"
    PEER = "peer"  # the other end reported an error
    CLOSED = "closed"  # the connection ended mid-flow
    TIMEOUT = "timeout"
    SINK = "sink"  # the receiver's sink refused the blocks


class TransferError(Exception):
    """A failed transfer, with a code both ends agree on (the peer gets it in an ERROR frame)."""

    def __init__(self, code: ErrorCode, message: str, flow_id: str = "") -> None:
        super().__init__(f"{code.value}: {message}" + (f" (flow {flow_id})" if flow_id else ""))
        self.code = code
        self.message = message
        self.flow_id = flow_id


@dataclass(frozen=True)
class FrameHeader:
    kind: FrameKind
    flow_id: str
    offset: int = 0
    total_bytes: int = 0
    block_ids: tuple[int, ...] = ()
    code: str = ""
    message: str = ""
    v: int = SCHEMA_VERSION

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "k": self.kind.value,
                "f": self.flow_id,
                "o": self.offset,
                "t": self.total_bytes,
                "b": list(self.block_ids),
                "c": self.code,
                "m": self.message,
                "v": self.v,
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> FrameHeader:
        try:
            d = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            kind = FrameKind(d["k"])
            if d["v"] != SCHEMA_VERSION:
                raise TransferError(ErrorCode.PROTOCOL, f"schema version {d['v']} != {SCHEMA_VERSION}")
            return cls(
                kind=kind,
                flow_id=str(d["f"]),
                offset=int(d["o"]),
                total_bytes=int(d["t"]),
                block_ids=tuple(int(b) for b in d["b"]),
                code=str(d["c"]),
                message=str(d["m"]),
            )
        except TransferError:
            raise
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise TransferError(ErrorCode.PROTOCOL, f"bad frame header: {exc!r}") from exc


def encode_frame(header: FrameHeader, payload: bytes | bytearray | memoryview = b"") -> list[bytes | memoryview]:
    """The frame as buffers to write in order (the payload is not copied)."""
    hdr = header.to_bytes()
    if len(hdr) > MAX_HEADER_BYTES:
        raise TransferError(ErrorCode.TOO_LARGE, f"header of {len(hdr)} bytes", header.flow_id)
    body = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    crc = zlib.crc32(body, zlib.crc32(hdr))
    return [PREFIX.pack(MAGIC, len(hdr), len(body), crc) + hdr, body]


def decode_prefix(raw: bytes, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[int, int, int]:
    """(header_len, payload_len, crc32) from the fixed prefix, enforcing the size limits."""
    magic, hdr_len, payload_len, crc = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise TransferError(ErrorCode.PROTOCOL, f"bad magic {magic!r}")
    if hdr_len > MAX_HEADER_BYTES:
        raise TransferError(ErrorCode.TOO_LARGE, f"header of {hdr_len} bytes > {MAX_HEADER_BYTES}")
    if payload_len > max_payload_bytes:
        raise TransferError(ErrorCode.TOO_LARGE, f"payload of {payload_len} bytes > {max_payload_bytes}")
    return hdr_len, payload_len, crc


def decode_body(hdr: bytes, payload: bytes, crc: int) -> FrameHeader:
    """Check the CRC, then parse the header. A mismatch names the flow when the header still parses."""
    if zlib.crc32(payload, zlib.crc32(hdr)) != crc:
        flow_id = ""
        try:
            flow_id = FrameHeader.from_bytes(hdr).flow_id
        except TransferError:
            pass  # the header itself is corrupt: report the checksum error without a flow id
        raise TransferError(ErrorCode.CHECKSUM, "crc32 mismatch", flow_id)
    return FrameHeader.from_bytes(hdr)


def decode_frame(raw: bytes, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[FrameHeader, bytes]:
    """Decode one whole frame held in memory (tests, shared-memory control records)."""
    if len(raw) < PREFIX.size:
        raise TransferError(ErrorCode.PROTOCOL, "short frame")
    hdr_len, payload_len, crc = decode_prefix(raw[: PREFIX.size], max_payload_bytes)
    end = PREFIX.size + hdr_len + payload_len
    if len(raw) != end:
        raise TransferError(ErrorCode.PROTOCOL, f"frame length {len(raw)} != {end}")
    hdr = raw[PREFIX.size : PREFIX.size + hdr_len]
    payload = raw[PREFIX.size + hdr_len : end]
    return decode_body(hdr, payload, crc), payload


def as_buffer(obj: object) -> memoryview:
    """bytes-like → a flat byte view; a CPU tensor (anything with `.numpy()`) is viewed, not copied."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return memoryview(obj).cast("B")
    numpy = getattr(obj, "numpy", None)
    if numpy is None:
        raise TypeError(f"cannot send a {type(obj).__name__}: need bytes, memoryview or a CPU tensor")
    contiguous = getattr(obj, "contiguous", None)
    arr = (contiguous() if contiguous else obj).numpy()  # type: ignore[operator]
    return memoryview(arr).cast("B")
