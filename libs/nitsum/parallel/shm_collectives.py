"""Shared-memory collectives for a CPU TP group whose workers share one host.

A gloo collective over loopback TCP costs ~1.3 ms between two processes and ~5 ms among four on a 2-core
machine (each ring hop is a socket wake-up of another process), and a decode step of an L-layer model makes
2L + 1 of them: on CPU that, not the matmuls, is most of a TP step. Workers of one host map the same memory,
so a group's collectives can go through it instead (vLLM's and SGLang's CPU backends do the same, in C++).

One segment per group, made once when the node world is built (`NodeWorld.attach_channels`), its name
unlinked as soon as every member mapped it. Per member a 64-byte header and two data buffers of
`slot_bytes`. A *round*: a member copies its contribution into its buffer `g % 2`, writes its sequence word
`g` and wakes whoever waits on that word (futex); then it waits until every other member's word is past
`g - 1`, and reads their buffers. All collectives are rounds:

- all_reduce: every member adds the buffers in rank order, so every member gets the same bits;
- all_gather: every member copies every buffer;
- broadcast / all-gather of bytes: one round carries each member's total length and first chunk.

Larger payloads go in chunks of `slot_bytes`, one round each. Why two buffers are enough: a member can be at
most one round ahead of another (round g + 1 needs everyone to have posted g + 1, which a member does only
after reading round g), so buffer g % 2 is rewritten (round g + 2) only after everyone read it.

Waiting: a short spin, then FUTEX_WAIT on the word (a syscall through ctypes, which releases the GIL) with a
20 ms timeout, after which the waiter checks the world's timeout, that the member it waits for still lives
(its pid, when it is in our pid namespace) and the segment's abort word (`abort`: a member tearing the group
down wakes everyone). A dead or hung member raises `ChannelError` (a RuntimeError, as gloo's errors are).

x86-64 only: the word is written after the data, and x86's stores are seen in program order; elsewhere the
world keeps gloo (`supported`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import time

import torch

SHM_DIR = "/dev/shm"
NAME_PREFIX = "nitsum-tpc-"
DEFAULT_SLOT_BYTES = 512 << 10  # a decode step's all-reduce of 64 x 2048 fp32 in one round
HEADER_BYTES = 64  # per member
DATA_OFFSET = 4096  # headers of up to 63 members, then the abort word
ABORT_OFFSET = DATA_OFFSET - 64
MAX_MEMBERS = ABORT_OFFSET // HEADER_BYTES
_SEQ, _PID, _LEN, _TOTAL, _NS, _OP = 0, 4, 8, 24, 40, 48  # header fields (LEN, TOTAL: a u64, OP: a u32, per buffer)
# What a round is part of (OP): members whose rounds disagree called different collectives (a bug on one side).
OP_ALL_REDUCE, OP_ALL_GATHER, OP_BYTES, OP_BARRIER = 1, 2, 3, 4
_MASK = 0xFFFFFFFF
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = 202  # x86-64
_POLL_S = 0.02  # a waiter's futex timeout: how often it checks the member it waits for
_SPIN = 200  # reads of the word before the first futex wait


class ChannelError(RuntimeError):
    """A member of the group died, hung past the world's timeout, or tore the group down."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscalls = None


def _libc_syscall():
    """(wait, wake): syscall(2) through a handle that releases the GIL (a FUTEX_WAIT blocks) and one that keeps
    it (a FUTEX_WAKE returns at once: releasing the GIL there made the step thread queue for it again after
    every round whenever another thread of the worker wanted it)."""
    global _syscalls
    if _syscalls is None:
        fns = []
        for lib in (ctypes.CDLL(None, use_errno=True), ctypes.PyDLL(None, use_errno=True)):
            fn = lib.syscall
            fn.restype = ctypes.c_long
            fn.argtypes = [
                ctypes.c_long,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_uint32,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_uint32,
            ]
            fns.append(fn)
        _syscalls = tuple(fns)
    return _syscalls


def supported() -> bool:
    """This machine can run the channel (x86-64 Linux with /dev/shm)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or not os.path.isdir(SHM_DIR):
        return False
    try:
        _libc_syscall()
    except (OSError, AttributeError):
        return False
    return True


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 when /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed worker whose parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def segment_bytes(size: int, slot_bytes: int) -> int:
    return DATA_OFFSET + size * 2 * slot_bytes


class ShmChannel:
    """One member's end of a group's segment (see the module docstring). Not thread-safe: one thread at a
    time per member runs the group's collectives, as with any process group."""

    def __init__(
        self,
        path: str,
        rank: int,
        size: int,
        *,
        create: bool,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 60.0,
    ) -> None:
        if not 2 <= size <= MAX_MEMBERS or not 0 <= rank < size:
            raise ValueError(f"a channel needs 2..{MAX_MEMBERS} members and a rank among them (rank {rank} of {size})")
        if slot_bytes <= 0 or slot_bytes % 4096:
            raise ValueError(f"slot_bytes must be a positive multiple of 4096, got {slot_bytes}")
        self.path, self.rank, self.size, self.slot_bytes, self.timeout_s = path, rank, size, slot_bytes, timeout_s
        total = segment_bytes(size, slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                # Reserved now (ENOSPC here, at boot), not at first touch (SIGBUS in a step).
                os.posix_fallocate(fd, 0, total)
            elif os.fstat(fd).st_size != total:
                raise ChannelError(f"{path}: {os.fstat(fd).st_size} bytes, expected {total} for {size} x {slot_bytes}")
            self._mm = mmap.mmap(fd, total)
        except BaseException:
            if create:  # nobody else knows the name yet: it must not stay in /dev/shm
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        mm = self._mm
        self._seq = [ctypes.c_uint32.from_buffer(mm, j * HEADER_BYTES + _SEQ) for j in range(size)]
        self._seq_addr = [ctypes.addressof(w) for w in self._seq]
        self._pid = [ctypes.c_uint32.from_buffer(mm, j * HEADER_BYTES + _PID) for j in range(size)]
        self._ns = [ctypes.c_uint64.from_buffer(mm, j * HEADER_BYTES + _NS) for j in range(size)]
        self._len = [
            [ctypes.c_uint64.from_buffer(mm, j * HEADER_BYTES + _LEN + 8 * b) for b in (0, 1)] for j in range(size)
        ]
        self._total = [
            [ctypes.c_uint64.from_buffer(mm, j * HEADER_BYTES + _TOTAL + 8 * b) for b in (0, 1)] for j in range(size)
        ]
        self._op = [
            [ctypes.c_uint32.from_buffer(mm, j * HEADER_BYTES + _OP + 4 * b) for b in (0, 1)] for j in range(size)
        ]
        self._abort = ctypes.c_uint32.from_buffer(mm, ABORT_OFFSET)
        self._abort_addr = ctypes.addressof(self._abort)
        data = torch.frombuffer(mm, dtype=torch.uint8)
        self._slots = [
            [data[self._offset(j, b) : self._offset(j, b) + slot_bytes] for b in (0, 1)] for j in range(size)
        ]
        self._mv = memoryview(mm)
        self._ns_me = pid_namespace()
        self._pid[rank].value = os.getpid()
        self._ns[rank].value = self._ns_me
        self._g = 0  # rounds done: every member starts from a fresh (zeroed) segment
        self._futex, self._futex_wake = _libc_syscall()
        self.closed = False
        self.rounds = 0

    def _offset(self, j: int, b: int) -> int:
        return DATA_OFFSET + (j * 2 + b) * self.slot_bytes

    # -- one round --------------------------------------------------------------------------------------
    def _round(self, nbytes: int, total: int, fill, op: int, same_size: bool = False) -> int:
        """Post `nbytes` (written by `fill(slot)`) as part of collective `op` and wait for everyone's post;
        returns the buffer index. ChannelError when a member posted another collective (or, `same_size`,
        another size): the members called different collectives, and reading on would mix their data."""
        if self.closed or self._abort.value:
            raise ChannelError(f"TP group channel {self.path} was torn down")
        g = (self._g + 1) & _MASK
        b = g & 1
        me = self.rank
        if nbytes:
            fill(self._slots[me][b][:nbytes])
        self._len[me][b].value = nbytes
        self._total[me][b].value = total
        self._op[me][b].value = op
        self._seq[me].value = g  # after the data: x86 keeps the order of stores
        self._futex_wake(_SYS_FUTEX, self._seq_addr[me], _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
        self._g = g
        self.rounds += 1
        before = (g - 1) & _MASK
        for j in range(self.size):
            if j != me and self._seq[j].value == before:
                self._wait(j, before)
        for j in range(self.size):
            if self._op[j][b].value != op or (same_size and self._len[j][b].value != nbytes):
                raise ChannelError(
                    f"TP group channel {self.path}: rank {j} is in another collective (op "
                    f"{self._op[j][b].value}, {self._len[j][b].value} bytes) than rank {me} (op {op}, "
                    f"{nbytes} bytes)"
                )
        return b

    def _wait(self, j: int, before: int) -> None:
        word = self._seq[j]
        for _ in range(_SPIN):
            if word.value != before:
                return
        deadline = time.monotonic() + self.timeout_s
        ts = _Timespec(0, int(_POLL_S * 1e9))
        while word.value == before:
            self._futex(_SYS_FUTEX, self._seq_addr[j], _FUTEX_WAIT, before, ctypes.byref(ts), None, 0)
            if word.value != before:
                return
            if self._abort.value or self.closed:
                raise ChannelError(
                    f"TP group channel {self.path} was torn down while rank {self.rank} waited for rank {j}"
                )
            pid = self._pid[j].value
            if pid and self._ns[j].value == self._ns_me and not _alive(pid):
                raise ChannelError(f"TP group peer rank {j} (pid {pid}) exited during a collective")
            if time.monotonic() > deadline:
                raise ChannelError(
                    f"TP group collective timed out after {self.timeout_s:.0f} s: rank {self.rank} waited for rank {j}"
                )

    # -- collectives --------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over members, in place (rank order: every member gets the same bits); returns `tensor`."""
        if not tensor.is_contiguous():
            tmp = tensor.contiguous()
            self.all_reduce(tmp)
            return tensor.copy_(tmp)
        flat = tensor.view(-1)
        esize = tensor.element_size()
        per_round = self.slot_bytes // esize
        for off in range(0, flat.numel(), per_round):
            part = flat[off : off + per_round]
            nbytes = part.numel() * esize
            b = self._round(
                nbytes,
                nbytes,
                lambda slot, part=part: slot.copy_(part.view(torch.uint8)),
                OP_ALL_REDUCE,
                same_size=True,
            )
            views = [self._slots[j][b][:nbytes].view(tensor.dtype) for j in range(self.size)]
            part.copy_(views[0])
            for v in views[1:]:
                part.add_(v)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every member's `tensor` (same shape everywhere), concatenated along `dim` in rank order."""
        src = tensor.contiguous().view(-1).view(torch.uint8)
        parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(self.size)]
        dsts = [p.view(-1).view(torch.uint8) for p in parts]
        nbytes = src.numel()
        for off in range(0, nbytes, self.slot_bytes):
            n = min(self.slot_bytes, nbytes - off)
            b = self._round(
                n, nbytes, lambda slot, off=off, n=n: slot.copy_(src[off : off + n]), OP_ALL_GATHER, same_size=True
            )
            for j in range(self.size):
                dsts[j][off : off + n].copy_(self._slots[j][b][:n])
        return torch.cat(parts, dim=dim)

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every member's payload (any lengths), in rank order."""
        view = memoryview(payload)
        out = [bytearray() for _ in range(self.size)]
        totals: list[int] | None = None
        off = 0
        while True:
            chunk = view[off : off + self.slot_bytes]
            b = self._round(
                len(chunk),
                len(payload),
                lambda slot, chunk=chunk: slot.copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8)),
                OP_BYTES,
            )
            if totals is None:
                totals = [self._total[j][b].value for j in range(self.size)]
            for j in range(self.size):
                n = self._len[j][b].value
                if n:
                    start = self._offset(j, b)
                    out[j] += self._mv[start : start + n]
            off += self.slot_bytes
            if off >= max(totals):
                return [bytes(x) for x in out]

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's payload, on every member."""
        if self.rank == 0:
            assert payload is not None, "the leader must provide the payload"
        data = self.all_gather_bytes(payload if self.rank == 0 else b"")[0]
        return payload if self.rank == 0 else data

    def barrier(self) -> None:
        self._round(0, 0, None, OP_BARRIER)

    # -- teardown -----------------------------------------------------------------------------------------
    def abort(self) -> None:
        """Tear the group down for every member: whoever waits in a collective of it raises at once."""
        if self.closed:
            return
        self._abort.value = 1
        for addr in self._seq_addr:
            self._futex_wake(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
        self.close()

    def close(self) -> None:
        """This member's end only (the mapping goes with the last reference to it)."""
        self.closed = True


def create_name(tag: str, start: int, tp: int) -> str:
    """A fresh segment name for group [start, start + tp) of the world tagged `tag` (pid + random suffix)."""
    return f"{NAME_PREFIX}{tag}-g{start}x{tp}-{os.getpid()}-{os.urandom(4).hex()}"
