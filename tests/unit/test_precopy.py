"""Pre-copy pieces on their own: migration flows and chunks from a plan, one-sided chunk copies between two
caches, and the shared-memory KV segment's lifecycle (real /dev/shm, real second process)."""

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from nitsum.kv.reshard import Transfer
from nitsum.node.precopy import PreCopy, plan_flows, transfer_block_bytes
from nitsum.transfer import shm

# [layers, K/V, blocks, block_size, heads, head_dim]
LAYERS, BLOCK, HEAD_DIM = 2, 4, 3


def block_bytes(t: Transfer) -> int:
    return transfer_block_bytes(t, BLOCK, HEAD_DIM, 4)


def test_flows_are_one_per_pair_with_chunks_of_whole_blocks():
    transfers = [
        Transfer(1, 0, 0, LAYERS, 0, 1, (5, 6, 7, 8, 9), (0, 1, 2, 3, 4)),  # 5 blocks of one head
        Transfer(0, 0, 0, LAYERS, 1, 2, (1, 2), (5, 6)),  # local
        Transfer(1, 0, 0, LAYERS, 2, 4, (3,), (7,)),  # same pair, two heads
    ]
    per_head_block = LAYERS * 2 * BLOCK * HEAD_DIM * 4
    flows = plan_flows(transfers, block_bytes, chunk_bytes=2 * per_head_block)
    assert [(f.index, f.src_worker, f.dst_worker, f.local) for f in flows] == [(0, 0, 0, True), (1, 1, 0, False)]
    assert [(c.transfer, c.start, c.end) for c in flows[1].chunks] == [(0, 0, 2), (0, 2, 4), (0, 4, 5), (2, 0, 1)]
    assert flows[1].size_bytes == 5 * per_head_block + 2 * per_head_block
    # A chunk budget below one block still moves one block per chunk.
    assert [len(f.chunks) for f in plan_flows(transfers, block_bytes, chunk_bytes=1)] == [2, 6]


def test_precopy_copies_chunks_one_sided_and_tracks_the_group():
    old = torch.arange(LAYERS * 2 * 10 * BLOCK * 4 * HEAD_DIM, dtype=torch.float32).view(
        LAYERS, 2, 10, BLOCK, 4, HEAD_DIM
    )
    new0 = torch.zeros(LAYERS, 2, 8, BLOCK, 2, HEAD_DIM)  # worker 0 will hold heads [2, 4)
    transfers = [Transfer(1, 0, 0, LAYERS, 2, 4, (3, 9, 4), (0, 5, 2))]
    flows = plan_flows(transfers, block_bytes, chunk_bytes=1)  # one block per chunk
    # Workers 1 (the source) and 2 form the old group; both see the same items.
    src = PreCopy(1, [1, 2], transfers, flows, old, (0, 4), {0: (new0, (2, 4))})
    other = PreCopy(2, [1, 2], transfers, flows, None, None, {})
    assert src.next_items() == [(0, 0)]
    assert src.run([(0, 0)]) == other.run([(0, 0)]) + 2 * LAYERS * 2 * BLOCK * HEAD_DIM * 4
    assert torch.equal(new0[:, :, 0], old[:, :, 3, :, 2:4]) and not new0[:, :, 5].any()
    assert not src.complete and src.next_items() == [(0, 1)]
    assert src.finish_mine() > 0 and src.complete
    assert torch.equal(new0[:, :, [0, 5, 2]], old[:, :, [3, 9, 4], :, 2:4])
    assert not other.complete  # worker 2 did not see the rest: it still knows what is left
    other.run([(0, 1), (0, 2)])
    assert other.complete and other.bytes_sent == 0


@pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")
def test_segment_is_shared_across_processes_and_unlinked_without_losing_memory():
    tag = "t" + uuid.uuid4().hex[:8]
    name = shm.segment_name(tag, 3, 1)
    shape = (2, 2, 4, 4, 1, 8)
    try:
        mine = shm.create(name, shape, torch.float32)
        assert shm.leftovers(tag) == [name] and not mine.any()
        code = (
            "import torch; from nitsum.transfer import shm; "
            f"t = shm.attach({name!r}, {shape!r}, torch.float32); t[1, 0, 2] = 7.0"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        shm.unlink(name)
        assert shm.leftovers(tag) == []
        assert mine[1, 0, 2].eq(7.0).all() and mine.sum().item() == 7.0 * 4 * 8
        mine[0] = 1.0  # still writable memory after the name is gone
        with pytest.raises(OSError):  # nobody can map it any more
            shm.attach(name, shape, torch.float32)
    finally:
        shm.unlink(name)


@pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")
def test_segment_of_another_size_is_refused_and_a_stale_one_is_replaced():
    tag = "t" + uuid.uuid4().hex[:8]
    name = shm.segment_name(tag, 1, 0)
    try:
        with open(os.path.join(shm.SHM_DIR, name), "wb") as stale:
            stale.write(b"x" * 10)
        seg = shm.create(name, (4, 4), torch.float32)
        assert not seg.any() and os.path.getsize(os.path.join(shm.SHM_DIR, name)) == 64
        with pytest.raises(OSError, match="expected 128"):
            shm.attach(name, (4, 8), torch.float32)
        with pytest.raises(AssertionError):
            shm.attach("../etc/passwd", (1,), torch.float32)
        with pytest.raises(OSError, match="no room"):
            shm.create(shm.segment_name(tag, 2, 0), (1 << 62,), torch.uint8)
    finally:
        shm.unlink(name)
    # Sparse at creation, its pages reserved later (after the name is gone, as prepare does it).
    sparse = shm.segment_name(tag, 3, 0)
    try:
        seg = shm.create(sparse, (256, 1024), torch.float32, reserve=False)
        reserve = shm.reserver(sparse)
        assert os.stat(os.path.join(shm.SHM_DIR, sparse)).st_blocks == 0
        shm.unlink(sparse)
        reserve()
        seg[-1, -1] = 3.0
        assert seg.sum().item() == 3.0
        with pytest.raises(OSError):
            reserve()  # made once; its descriptor is closed
        reserve.close()  # idempotent
    finally:
        shm.unlink(sparse)
    assert shm.leftovers(tag) == []


def test_a_build_is_ready_with_its_runner_and_done_after_its_reservation():
    """The prepare's new-runner thread: the final prepare ack and the commit need only the runner (`ready`); a
    reservation that fails afterwards is still an error of the build (commit refuses the epoch when it already
    failed; one still running goes on after the switch and is logged if it fails)."""
    from nitsum.node.build import RunnerBuild as _Build

    release = threading.Event()
    reserved = []

    def reserve():
        release.wait(30)
        reserved.append(True)
        raise OSError("no room left in /dev/shm")

    build = _Build(lambda: "runner", start=False, after=reserve)
    assert not build.ready and not build.done
    build.start()
    build.wait_ready()
    assert build.ready and build.runner == "runner" and build.runner_error == "" and not build.done
    release.set()
    build.wait()
    assert build.done and reserved == [True] and "no room left" in build.error and build.runner_error == ""

    cancelled = []
    never = _Build(lambda: "runner", start=False, cancel=lambda: cancelled.append(True), after=reserve)
    never.finish()  # a prepare dropped before its build started: given up, not run
    assert cancelled == [True] and never.runner is None


@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
def test_a_reservation_is_paced_in_pieces_and_stops_at_the_next_one_when_closed(monkeypatch):
    """A commit leaves its new cache's reservation running (shm.Reserver): in pieces with rests between
    them, so that its page zeroing does not land on a few decode steps; a worker that stops (or drops the
    segment) closes it, and it ends at its next piece, closing its own descriptor."""
    tag = f"t{uuid.uuid4().hex[:8]}"
    name = shm.segment_name(tag, 1, 0)
    monkeypatch.setattr(shm, "RESERVE_CHUNK_BYTES", 1 << 20)
    pieces, second = [], threading.Event()
    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        pieces.append((offset, length))
        real(fd, offset, length)
        if len(pieces) == 2:
            second.set()
            time.sleep(0.2)  # the close below comes while this piece runs

    monkeypatch.setattr(shm.os, "posix_fallocate", fallocate)
    try:
        shm.create(name, (8, 1 << 20), torch.uint8, reserve=False)  # 8 MiB: 8 pieces
        reserve = shm.reserver(name)
        thread = threading.Thread(target=reserve)
        thread.start()
        assert second.wait(10)
        reserve.close()  # in progress: it stops at its next piece and closes the descriptor itself
        thread.join(10)
        assert not thread.is_alive()
        assert pieces == [(0, 1 << 20), (1 << 20, 1 << 20)]
        with pytest.raises(OSError):
            reserve()  # given up: never again
        reserve.close()  # idempotent
        # Unhindered, it backs every page, piece by piece.
        pieces.clear()
        monkeypatch.setattr(shm.os, "posix_fallocate", real)
        full = shm.reserver(name)
        full()
        assert os.stat(os.path.join(shm.SHM_DIR, name)).st_blocks * 512 >= 8 << 20
    finally:
        shm.unlink(name)


def test_a_build_from_the_pool_is_done_at_once_without_a_thread():
    """A change whose new cache is the spare arena and whose runner waits in the pool has nothing to build or
    reserve: its build is done when made, and waiting on it or finishing it returns at once."""
    from nitsum.node.build import RunnerBuild as _Build

    runner = object()
    build = _Build.at_once(runner)
    assert build.ready and build.done and build.runner is runner and build.error == ""
    build.wait_ready()
    build.wait()
    build.stop_after()
    build.finish()
    assert build.done
    assert not any(t.name == "nitsum-prepare-build" for t in threading.enumerate())
