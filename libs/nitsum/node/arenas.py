"""KV arenas (shm mode): the shared-memory segment behind the cache in use, a spare one, and their recycling.

Both are made and reserved at boot, each as large as the largest level's cache. A change's new cache is a
view of the spare, and its commit makes the old cache's arena the spare: a change allocates, zeroes and
reserves no memory (64 MiB of page zeroing per changed worker was the largest CPU cost of a change here, on
top of the old groups' steps). The price is a second arena per worker for as long as it runs. Recycling
needs every worker sharing this host's memory to be able to open this one's /proc/<pid>/fd (`recycle`).
"""

from __future__ import annotations

import logging
import os

from nitsum.node.reaper import Reaper
from nitsum.transfer import shm

log = logging.getLogger("nitsum.node.arenas")


class KvArenas:
    """The arena in use (None: a private or adopted cache) and the spare; what goes frees in the reaper."""

    def __init__(self, node_tag: str, rank: int, arena_bytes: int, reaper: Reaper, recycle: bool) -> None:
        self.node_tag = node_tag
        self.rank = rank
        self.arena_bytes = arena_bytes
        self.recycle = recycle
        self.in_use: shm.Arena | None = None
        self.spare: shm.Arena | None = None
        self._reaper = reaper

    def reserve_at_boot(self, with_in_use: bool) -> None:
        """Make the spare (and, `with_in_use`, the arena of the first cache); on failure recycle nothing."""
        if not self.recycle:
            return
        try:
            self.spare = self.new()
            if with_in_use:
                self.in_use = self.new()
        except (OSError, RuntimeError) as exc:
            log.warning("worker %d: no KV arenas (%s): every TP change makes its new cache afresh", self.rank, exc)
            self.release(self.spare)
            self.spare, self.in_use, self.recycle = None, None, False

    def new(self) -> shm.Arena:
        name = shm.segment_name(self.node_tag, 0, self.rank) + f"-arena-{os.urandom(4).hex()}"
        return shm.Arena.create(name, self.arena_bytes)

    def named(self, segment: str) -> shm.Arena:
        """An arena from now on under an epoch's segment name (this worker's spare was gone): not reserved."""
        return shm.Arena.create(segment, self.arena_bytes, reserve=False, keep_name=True)

    def take_spare(self) -> shm.Arena | None:
        spare, self.spare = self.spare, None
        return spare

    def release(self, arena: shm.Arena | None) -> None:
        """An arena nothing uses any more: its descriptor now, its pages in the reaper (MADV_REMOVE)."""
        if arena is not None:
            arena.close()
            self._reaper.retire(own=[arena.flat])

    def switch(self, new: shm.Arena | None) -> bool:
        """Commit: the new cache's arena is in use; the old one becomes the spare (its pages stay: nothing to
        free or zero) or is released. True when an old arena backed the old cache (it is not the caller's
        to free then)."""
        if new is None and self.in_use is None:
            return False
        old, self.in_use = self.in_use, new
        if old is None:
            return False
        if self.spare is None and self.recycle:
            self.spare = old
        else:
            self.release(old)
        return True

    @property
    def held(self) -> int:
        """Arenas this worker keeps (their descriptors are open): the one in use and the spare."""
        return sum(a is not None and a.fd is not None for a in (self.in_use, self.spare))

    def close(self) -> None:
        for arena in (self.in_use, self.spare):
            if arena is not None:
                arena.close()  # the memory goes with the last mapping (the cache in use keeps computing)
        self.in_use = self.spare = None
        self.recycle = False
