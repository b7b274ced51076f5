"""KV bytes between the workers of one host through POSIX shared memory (/dev/shm): the one shm module.

Every segment is a file `SEGMENT_PREFIX...` in /dev/shm, so one listing (`leftovers`) sees all of them. Two uses:

TP changes (the node runtime): a worker's new KV cache in a segment, so that other workers of the host can write
migrated blocks straight into it (one-sided: no partner has to post a receive).

Lifecycle (NodeRuntime.prepare): the destination `create`s its segment (named from node, epoch and worker,
so every worker can compute every name), the sources `attach` it, and once the span agreed that everyone
mapped what they need, the destination `unlink`s the name. The memory lives on in the mappings and goes
with the last of them; /dev/shm holds nothing from then on, even if a worker dies later. An abort or a
failed prepare unlinks too; `leftovers` lists what a node left behind (tests, and a worker at stop).

Space: `create` refuses a segment that /dev/shm has no room for (statvfs; an OSError at prepare: the
transition is refused and the old topology keeps serving) and by default reserves it with posix_fallocate,
so that no write can later hit a missing page (SIGBUS). With `reserve=False` the name is created sparse (a
few microseconds instead of ~20-100 ms of page zeroing for 64 MiB) and the caller runs `reserver(name)()` later,
off its critical path, before it relies on the memory.

P/D hand-offs and prefix reuse (the worker's KvMover): the sender `publish`es a flow into a fresh segment and hands
the small `ShmHandle` to the receiver over the control plane (msgpack-able: `to_wire()` / `from_wire()`). The
receiver `receive`s (open read-only, verify the CRC32, copy out). Whatever happens, the sender `release`s the
handle: that unlinks the segment, so a failed transfer never leaks memory. On CUDA, same-host transfers are
device copies instead and never come here.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import threading
import time
import zlib
from dataclasses import dataclass

import torch

from nitsum.transfer.framing import ErrorCode, TransferError, as_buffer

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "nitsum-kv-"
FLOW_PREFIX = SEGMENT_PREFIX + "flow-"  # a published flow's segment (a node tag never starts with "flow-")
MAX_SEGMENT_BYTES = 1 << 32  # the largest flow `publish` takes


def available() -> bool:
    """Whether this host offers POSIX shared memory as files we can create (Linux /dev/shm)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def segment_name(node_tag: str, epoch: int, worker: int) -> str:
    return f"{SEGMENT_PREFIX}{node_tag}-e{epoch}-w{worker}"


def _path(name: str) -> str:
    assert name.startswith(SEGMENT_PREFIX) and "/" not in name, f"{name!r} is not a KV segment name"
    return os.path.join(SHM_DIR, name)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


nbytes_of = _nbytes


def _new_file(name: str, nbytes: int, reserve: bool, what: str) -> tuple[str, int]:
    """Create segment file `name` of `nbytes` (a stale one of that name is replaced: names carry the epoch, so
    it can only be a leftover of a crashed worker of this very node); OSError when /dev/shm has no room.
    `reserve`: back every page now, else sparse. Returns its path and an open descriptor."""
    path = _path(name)
    stat = os.statvfs(SHM_DIR)
    if stat.f_bavail * stat.f_frsize < nbytes:
        raise OSError(f"no room for a {nbytes}-byte {what} in {SHM_DIR} ({stat.f_bavail * stat.f_frsize} free)")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if reserve:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        else:
            os.ftruncate(fd, max(nbytes, 1))
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return path, fd


def create(name: str, shape: tuple[int, ...], dtype: torch.dtype, reserve: bool = True) -> torch.Tensor:
    """A zeroed tensor of `shape` backed by a new segment `name` (see `_new_file`)."""
    path, fd = _new_file(name, _nbytes(shape, dtype), reserve, "KV segment")
    os.close(fd)
    try:
        return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    except RuntimeError:
        os.unlink(path)
        raise


# A reservation backs the pages in pieces, and rests between them three times as long as the last piece took:
# nothing waits for it (the pages a worker writes first are backed by those writes), and its page zeroing (~16 ms
# of CPU per 64 MiB) should not land on one or two decode steps of a busy host. (Not a lower thread priority: a
# SCHED_IDLE or nice-19 Python thread waiting to take the GIL back stalls the step thread that must hand it over
# -- 650 ms once, here.) Between two pieces it can also be given up (`close`).
RESERVE_CHUNK_BYTES = 2 << 20
RESERVE_REST_FACTOR = 3.0


class Reserver:
    """For a segment created sparse: calling it backs every page (OSError when /dev/shm ran out meanwhile), in
    paced pieces (see RESERVE_CHUNK_BYTES); `close` gives the descriptor back without reserving, or stops a
    reservation in progress at its next piece (the segment is being dropped, the worker stops). The descriptor is opened at construction, so either still
    works after the name is unlinked; it is closed once, by whichever ends it."""

    def __init__(self, name: str) -> None:
        self._fd: int | None = os.open(_path(name), os.O_RDWR)
        self._lock = threading.Lock()
        self._running = False
        self._stopped = False

    def __call__(self) -> None:
        with self._lock:
            fd = self._fd
            if fd is None or self._running or self._stopped:
                raise OSError("the segment's reservation was already made or given up")
            self._running = True
        try:
            size = os.fstat(fd).st_size
            for offset in range(0, size, RESERVE_CHUNK_BYTES):
                if self._stopped:
                    return
                t0 = time.perf_counter()
                os.posix_fallocate(fd, offset, min(RESERVE_CHUNK_BYTES, size - offset))
                if offset + RESERVE_CHUNK_BYTES < size:
                    time.sleep(RESERVE_REST_FACTOR * (time.perf_counter() - t0))
        finally:
            with self._lock:
                self._fd, self._running, self._stopped = None, False, True
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            if self._running:
                return  # the reserving thread closes it after its current piece
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class Arena:
    """One of a worker's KV arenas, kept for the next TP change instead of freed: a segment of /dev/shm held by
    its descriptor (its name, if it had one, is gone) and mapped whole (`flat`, uint8). A change's new cache is
    a view of the worker's spare arena (`view`), so a change allocates, zeroes and reserves nothing; commit
    makes the old cache's arena the spare. Other workers of the host map it through `handle`
    (/proc/<pid>/fd/<fd>: the owner's descriptor, no name in /dev/shm), which needs them in the owner's pid
    namespace (kv_hosts.Member.pidns). The memory goes with the descriptor and the last mapping (`close` the
    one, drop the other)."""

    def __init__(self, fd: int, nbytes: int, flat: torch.Tensor) -> None:
        self.fd: int | None = fd
        self.nbytes = nbytes
        self.flat = flat
        self.handle = f"/proc/{os.getpid()}/fd/{fd}"

    @staticmethod
    def create(name: str, nbytes: int, reserve: bool = True, keep_name: bool = False) -> Arena:
        """A new arena of `nbytes` (zeroed; OSError when /dev/shm has no room), made through segment `name`,
        which is unlinked here unless `keep_name` (a prepare's new cache: the others attach it by name first).
        `reserve`: back every page now (boot), else sparse (the caller reserves it later, `reserver(name)`)."""
        path, fd = _new_file(name, nbytes, reserve, "KV arena")
        try:
            flat = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        except RuntimeError:
            os.close(fd)
            os.unlink(path)
            raise
        if not keep_name:
            os.unlink(path)
        return Arena(fd, nbytes, flat)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A cache of `shape` over the arena's first bytes. What an earlier cache left there stays (no zeroing):
        every block a request uses is written before attention reads it, except the positions past the request's
        length inside its last block, which attention masks out -- stale KV values there are finite numbers, so
        the mask zeroes their weight (a NaN there would not be: nothing writes one into a cache)."""
        nbytes = _nbytes(shape, dtype)
        assert nbytes <= self.nbytes, f"a {nbytes}-byte cache does not fit a {self.nbytes}-byte arena"
        return self.flat[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Give the descriptor back (idempotent); the mapping, and so the memory, lives while referenced."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def attach_handle(handle: str, shape: tuple[int, ...], dtype: torch.dtype, pid: int) -> torch.Tensor:
    """Map another worker's arena by its `handle` (Arena.handle of worker process `pid`): OSError when it is not
    a KV segment of that process or is too small for the cache this worker expects."""
    parts = handle.split("/")
    if (
        len(parts) != 5
        or parts[:2] != ["", "proc"]
        or parts[2] != str(pid)
        or parts[3] != "fd"
        or not parts[4].isdigit()
    ):
        raise OSError(f"{handle!r} is not a KV arena handle of process {pid}")
    target = os.readlink(handle)
    if not target.startswith(os.path.join(SHM_DIR, SEGMENT_PREFIX)):
        raise OSError(f"{handle!r} is not a KV segment ({target})")
    nbytes = _nbytes(shape, dtype)
    if os.stat(handle).st_size < nbytes:
        raise OSError(f"arena {handle} holds {os.stat(handle).st_size} bytes, less than the {nbytes} expected")
    return torch.from_file(handle, shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def reserver(name: str) -> Reserver:
    """The `Reserver` of segment `name` (opened now, before its name is unlinked)."""
    return Reserver(name)


def attach(name: str, shape: tuple[int, ...], dtype: torch.dtype, allow_larger: bool = False) -> torch.Tensor:
    """Map another worker's segment (writes go straight into its memory). OSError when it is missing or
    does not have the size this worker expects (the two sides disagree on the cache geometry)."""
    path = _path(name)
    nbytes = _nbytes(shape, dtype)
    size = os.stat(path).st_size
    if size < max(nbytes, 1) or (size != max(nbytes, 1) and not allow_larger):
        raise OSError(f"segment {name} holds {size} bytes, expected {nbytes}")
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def unlink(name: str) -> None:
    """Remove the name (idempotent); mapped memory stays valid until its last mapping goes."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def leftovers(node_tag: str | None = None) -> list[str]:
    """KV segment names present in /dev/shm (of one node when `node_tag` is given)."""
    if not os.path.isdir(SHM_DIR):
        return []
    prefix = SEGMENT_PREFIX + (f"{node_tag}-" if node_tag is not None else "")
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


# -- flows: published by one worker, received by another, released by the publisher ---------------------
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
        self._segments: set[str] = set()

    def publish(self, flow_id: str, payload: object, block_ids: tuple[int, ...] = ()) -> ShmHandle:
        data = as_buffer(payload)
        if len(data) > MAX_SEGMENT_BYTES:
            raise TransferError(ErrorCode.TOO_LARGE, f"{len(data)} bytes", flow_id)
        name = FLOW_PREFIX + secrets.token_hex(8)
        path, fd = _new_file(name, len(data), True, "flow segment")
        try:
            with open(fd, "wb", closefd=True) as out:
                out.write(data)
        except BaseException:
            unlink(name)
            raise
        self._segments.add(name)
        return ShmHandle(flow_id, name, len(data), zlib.crc32(data), block_ids)

    def release(self, handle: ShmHandle) -> None:
        """Unlink the segment (idempotent): after an ACK, an error, or a timeout alike."""
        if handle.segment in self._segments:
            self._segments.discard(handle.segment)
            unlink(handle.segment)

    def live_segments(self) -> list[str]:
        return sorted(self._segments)

    def close(self) -> None:
        for name in sorted(self._segments):
            self._segments.discard(name)
            unlink(name)


def receive(handle: ShmHandle) -> bytes:
    """Attach, verify and copy out one published flow. Raises TransferError; never unlinks."""
    if not handle.segment.startswith(FLOW_PREFIX) or "/" in handle.segment:
        raise TransferError(ErrorCode.PROTOCOL, f"segment {handle.segment!r} is not a flow segment", handle.flow_id)
    try:
        fd = os.open(_path(handle.segment), os.O_RDONLY)
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
