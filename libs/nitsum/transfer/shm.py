"""KV bytes between workers on one host through POSIX shared memory, with explicit release.

The sender `publish`es a flow into a fresh segment and hands the small `ShmHandle` to the receiver over
the control plane (msgpack-able: `to_wire()` / `from_wire()`). The receiver `receive`s (attach, verify
the CRC32, copy out, detach). Whatever happens, the sender `release`s the handle: that unlinks the
segment, so a failed transfer never leaks memory. On CUDA, same-host transfers are device copies instead
and never come here.
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm binding (what shared_memory itself uses)
import mmap
import os
import secrets
import zlib
from dataclasses import dataclass
from multiprocessing import shared_memory

from nitsum.transfer.framing import ErrorCode, TransferError, as_buffer

SEGMENT_PREFIX = "nkv_"
MAX_SEGMENT_BYTES = 1 << 32


@dataclass(frozen=True)
class ShmHandle:
    flow_id: str
    segment: str
    size_bytes: int
    crc32: int
    block_ids: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, object]:
        return {"f": self.flow_id, "s": self.segment, "n": self.size_bytes, "c": self.crc32, "b": list(self.block_ids)}

    @classmethod
    def from_wire(cls, d: dict[str, object]) -> ShmHandle:
        try:
            return cls(
                str(d["f"]),
                str(d["s"]),
                int(d["n"]),
                int(d["c"]),  # type: ignore[arg-type]
                tuple(int(b) for b in d["b"]),
            )  # type: ignore[union-attr]
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(ErrorCode.PROTOCOL, f"bad shm handle: {exc!r}") from exc


class ShmPublisher:
    """The sending side: owns every segment it published until `release` (or `close`)."""

    def __init__(self) -> None:
        self._segments: dict[str, shared_memory.SharedMemory] = {}

    def publish(self, flow_id: str, payload: object, block_ids: tuple[int, ...] = ()) -> ShmHandle:
        data = as_buffer(payload)
        if len(data) > MAX_SEGMENT_BYTES:
            raise TransferError(ErrorCode.TOO_LARGE, f"{len(data)} bytes", flow_id)
        name = SEGMENT_PREFIX + secrets.token_hex(8)
        seg = shared_memory.SharedMemory(name=name, create=True, size=max(len(data), 1))
        try:
            seg.buf[: len(data)] = data
        except BaseException:
            seg.close()
            seg.unlink()
            raise
        self._segments[name] = seg
        return ShmHandle(flow_id, name, len(data), zlib.crc32(data), block_ids)

    def release(self, handle: ShmHandle) -> None:
        """Unlink the segment (idempotent): after an ACK, an error, or a timeout alike."""
        seg = self._segments.pop(handle.segment, None)
        if seg is not None:
            seg.close()
            seg.unlink()

    def live_segments(self) -> list[str]:
        return sorted(self._segments)

    def close(self) -> None:
        for name in list(self._segments):
            seg = self._segments.pop(name)
            seg.close()
            seg.unlink()


def receive(handle: ShmHandle) -> bytes:
    """Attach, verify and copy out one published flow. Raises TransferError; never unlinks."""
    if not handle.segment.startswith(SEGMENT_PREFIX):
        raise TransferError(ErrorCode.PROTOCOL, f"segment {handle.segment!r} is not a KV segment", handle.flow_id)
    # Attach read-only through shm_open, not SharedMemory: SharedMemory would register the segment with
    # this process's resource tracker, which unlinks it at exit although the publisher owns it.
    try:
        fd = _posixshmem.shm_open("/" + handle.segment, os.O_RDONLY, mode=0o600)
    except FileNotFoundError as exc:
        raise TransferError(ErrorCode.CLOSED, "segment already released", handle.flow_id) from exc
    try:
        if handle.size_bytes > os.fstat(fd).st_size:
            raise TransferError(ErrorCode.PROTOCOL, "handle larger than its segment", handle.flow_id)
        if handle.size_bytes == 0:
            data = b""
        else:
            with mmap.mmap(fd, handle.size_bytes, prot=mmap.PROT_READ) as view:
                data = view[: handle.size_bytes]
    finally:
        os.close(fd)
    if zlib.crc32(data) != handle.crc32:
        raise TransferError(ErrorCode.CHECKSUM, "crc32 mismatch", handle.flow_id)
    return data
