"""Memory a committed TP change no longer needs, released off the step thread.

After a commit a worker holds what the old topology used: its old KV cache (tens of MB), its mappings of
the other workers' new caches (it wrote its pre-copy and delta through them) and the pre-copy's state.
Dropping them inside the commit put their cost into the pause a stream sees: freeing a 64 MiB cache is
~9 ms of kernel page freeing on these machines (the last mapping of an unlinked /dev/shm segment, or a big
anonymous allocation), and torch frees a storage in the thread that drops it, with the GIL held -- so the
step thread could not run the new group's first step meanwhile.

`Reaper.retire` takes the references instead; its thread hands the pages back with `madvise` through
ctypes (a foreign call that releases the GIL: the step thread keeps running Python), then drops the
references (unmapping a range with no pages left is cheap). Pages are only *freed* for memory this worker
owns alone (`own=True`: its old cache); for a mapping of another worker's cache only this process's page
table entries go (MADV_DONTNEED on a shared mapping leaves the file's pages to their owner).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import sys
import threading
from typing import Any

import torch

log = logging.getLogger("nitsum.node.reaper")

MADV_DONTNEED = 4
MADV_REMOVE = 9  # Linux: free the backing store of a shared mapping (tmpfs / shmem) -- a hole punch

_libc: Any = None


def _madvise() -> Any:
    global _libc
    if _libc is None:
        if not sys.platform.startswith("linux"):
            _libc = False
        else:
            libc = ctypes.CDLL(None, use_errno=True)  # CDLL, not PyDLL: the call releases the GIL
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            libc.madvise.restype = ctypes.c_int
            _libc = libc
    return _libc.madvise if _libc else None


def release_pages(tensor: torch.Tensor, own: bool) -> int:
    """Hand back the whole pages of `tensor`'s storage (CPU only); returns the bytes advised (0: nothing
    done, e.g. not Linux, not CPU, or a storage smaller than a page). `own`: this process is the only user of
    the memory, so its pages may be freed for good (MADV_REMOVE on shared memory, else MADV_DONTNEED);
    otherwise only this process's mapping of them goes (MADV_DONTNEED). The tensor's contents are undefined
    afterwards: call it only on memory nobody reads again."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return 0
    storage = tensor.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    page = mmap.PAGESIZE
    start, end = -(-ptr // page) * page, (ptr + nbytes) // page * page  # only pages wholly inside it
    if end <= start:
        return 0
    for advice in (MADV_REMOVE, MADV_DONTNEED) if own else (MADV_DONTNEED,):
        if madvise(start, end - start, advice) == 0:
            return end - start
    return 0  # refused (EINVAL for private memory and MADV_REMOVE is tried first): the drop frees it


class Reaper:
    """One daemon thread per worker that releases retired memory in the order it was retired."""

    def __init__(self, name: str = "nitsum-reaper") -> None:
        self._name = name
        self._queue: queue.Queue[tuple[list[torch.Tensor], list[torch.Tensor], list[Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.bytes_released = 0

    def retire(self, own: list[torch.Tensor] = (), mapped: list[torch.Tensor] = (), other: list[Any] = ()) -> None:
        """Take these references: `own` memory is freed, `mapped` (other workers' memory) unmapped, `other`
        objects (whatever else still points at them) dropped, all in the reaper's thread."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((list(own), list(mapped), list(other)))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._release(*item)
            del item  # nothing of it may outlive this turn (the thread then waits, maybe for hours)

    def _release(self, own: list[torch.Tensor], mapped: list[torch.Tensor], other: list[Any]) -> None:
        """One retire's memory; every reference it got goes with this frame (a loop variable left in `_run`
        kept the last tensor alive -- on CUDA a whole old cache -- until the next retire)."""
        try:
            for t in own:
                self.bytes_released += release_pages(t, own=True)
            for t in mapped:
                release_pages(t, own=False)
        except Exception:  # never let a release kill the thread: the drop below frees it anyway
            log.exception("releasing retired KV memory")
        own.clear(), mapped.clear(), other.clear()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until everything retired so far is released (the thread stops; a later retire restarts it)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)
