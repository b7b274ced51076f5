"""The reaper frees what a commit retired, in its own thread, without touching memory it does not own."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import weakref

import pytest
import torch

from nitsum.node.reaper import Reaper, release_pages
from nitsum.transfer import shm

linux_shm = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and shm.available()), reason="needs Linux /dev/shm"
)


def _resident_kb(path: str) -> int:
    """KiB of shared memory a tmpfs file holds (its allocated blocks)."""
    return os.stat(path).st_blocks // 2


@linux_shm
def test_own_segment_pages_are_freed_and_a_peer_mapping_keeps_the_owners_data(tmp_path):
    name = f"{shm.SEGMENT_PREFIX}reaper-test-{os.getpid()}-e1-w0"
    shape = (64, 4096)  # 1 MiB of float32
    try:
        owner = shm.create(name, shape, torch.float32)  # reserved: every page allocated
        peer = shm.attach(name, shape, torch.float32)
        path = os.path.join(shm.SHM_DIR, name)
        owner.fill_(3.0)
        full_kb = _resident_kb(path)
        assert full_kb >= math.prod(shape) * 4 // 1024

        # A peer's mapping goes: only its page table entries, the owner's data stays.
        assert release_pages(peer, own=False) == math.prod(shape) * 4
        assert _resident_kb(path) == full_kb
        assert torch.equal(owner, torch.full(shape, 3.0))

        # The owner's release frees the segment's pages (reads now see a hole: zeros).
        assert release_pages(owner, own=True) == math.prod(shape) * 4
        assert _resident_kb(path) < full_kb
        assert float(owner.abs().sum()) == 0.0
    finally:
        shm.unlink(name)


def test_private_memory_is_released_with_dontneed():
    t = torch.full((1 << 20,), 7.0)  # 4 MiB: its own mapping, whole pages inside
    advised = release_pages(t, own=True)
    if not sys.platform.startswith("linux"):
        assert advised == 0
        return
    assert advised > 0 and advised <= t.numel() * 4
    assert float(t[(t.numel() // 2)]) == 0.0  # a page in the middle was handed back (reads as zero)


def test_tiny_and_non_cpu_tensors_are_left_alone():
    small = torch.ones(4)  # inside one page, maybe sharing it with other allocations: never advised
    assert release_pages(small, own=True) == 0
    assert torch.equal(small, torch.ones(4))
    if torch.cuda.is_available():
        assert release_pages(torch.ones(1 << 20, device="cuda"), own=True) == 0


def test_reaper_drops_references_in_its_own_thread_and_drain_waits():
    dropped_in = []

    class Marker:
        def __del__(self):
            dropped_in.append(threading.current_thread().name)

    reaper = Reaper("test-reaper")
    own = torch.zeros(1 << 20)
    reaper.retire(own=[own], mapped=[], other=[Marker()])
    del own
    reaper.drain()
    assert dropped_in == ["test-reaper"]
    if sys.platform.startswith("linux"):
        assert reaper.bytes_released > 0
    # It restarts after a drain.
    reaper.retire(other=[Marker()])
    reaper.drain()
    assert dropped_in == ["test-reaper", "test-reaper"]


def test_nothing_retired_stays_alive_after_its_release():
    """The reaper keeps no reference to what it released (on CUDA an old cache kept alive until the next retire
    would hold a whole cache's device memory)."""
    reaper = Reaper("test-reaper-refs")
    own, m1, m2 = torch.zeros(1 << 18), torch.zeros(1 << 18), torch.zeros(1 << 18)
    refs = [weakref.ref(t) for t in (own, m1, m2)]
    reaper.retire(own=[own], mapped=[m1, m2], other=[])
    del own, m1, m2
    deadline = time.monotonic() + 30  # a hang guard: the thread runs this at once
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(r() is None for r in refs)  # freed while the reaper thread still runs (not drained)
    reaper.drain()
