"""The KV paths of the node runtime, one test per path (shm arena, shm segment, tcp, p2p): which path a prepare
takes for this worker's new cache, and what its `allocate` makes (the new cache, and how the new runner is
built). No node world: the node is a stand-in holding real KV arenas, a real reaper and a stand-in pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nitsum.node.arenas import KvArenas
from nitsum.node.kv_paths import P2pPath, ShmArenaPath, ShmSegmentPath, TcpPath, path_for
from nitsum.node.reaper import Reaper
from nitsum.node.transition import Transition
from nitsum.topology import Group
from nitsum.transfer import shm

SHAPE = (2, 2, 4, 4, 1, 8)  # [layers, K/V, blocks, block_size, local kv heads, head_dim]
ARENA_BYTES = 2 * 2 * 4 * 4 * 2 * 8 * 4  # room for the TP=1 cache (two kv heads) of this layout

needs_shm = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")


class _Runner:
    def __init__(self, with_cache: bool) -> None:
        self.kv_cache_shape = SHAPE
        self.kv_cache = torch.zeros(SHAPE) if with_cache else None


class _Pool:
    def __init__(self, pooled: bool) -> None:
        self.idle = _Runner(with_cache=False) if pooled else None
        self.built: list[bool] = []  # with_cache of each runner built

    def pooled(self, group: Group):
        runner, self.idle = self.idle, None
        return runner

    def runner(self, group: Group, with_cache: bool = True):
        self.built.append(with_cache)
        return _Runner(with_cache)


def _node(mode: str, shm: bool = True, recycle: bool = True, spare: bool = True, pooled: bool = True, tag: str = "t"):
    reaper = Reaper("test-reaper")
    arenas = KvArenas(f"{tag}{id(reaper) % 100000}", 0, ARENA_BYTES, reaper, recycle)
    if spare:
        arenas.reserve_at_boot(with_in_use=False)
    layout = SimpleNamespace(cache_shape=lambda tp: SHAPE, dtype=torch.float32)
    return SimpleNamespace(
        kv_path=mode,
        rank=0,
        members=[SimpleNamespace(shm=shm)],
        arenas=arenas,
        layout=layout,
        node_tag=arenas.node_tag,
        pool=_Pool(pooled),
        reaper=reaper,
    )


def _transition(node, epoch: int = 3):
    t = SimpleNamespace(
        node=node, epoch=epoch, my_new=Group(0, 1), new_cache=None, build=None, arena=None, segment=None, runner=None
    )
    t.adopt_runner = lambda: Transition.adopt_runner(t)
    return t


@needs_shm
def test_shm_arena_path_views_the_spare_and_takes_the_pooled_runner_at_once():
    node = _node("shm")
    assert isinstance(path_for(node), ShmArenaPath) and node.arenas.held == 1
    spare = node.arenas.spare
    t = _transition(node)
    ShmArenaPath().allocate(t)
    assert t.arena is spare and node.arenas.spare is None and t.segment is None
    assert tuple(t.new_cache.shape) == SHAPE and t.new_cache.dtype == torch.float32
    # A pooled runner: the build is done already (no thread), nothing was built.
    assert t.build.done and t.build.ready and t.build.runner is not None and node.pool.built == []
    # Without a spare the next prepare takes the segment path.
    assert isinstance(path_for(node), ShmSegmentPath)
    node.arenas.release(t.arena)
    node.arenas.close()
    node.reaper.drain()


@needs_shm
def test_shm_segment_path_makes_a_named_sparse_segment_and_reserves_it_in_the_build():
    node = _node("shm", recycle=False, spare=False)
    assert isinstance(path_for(node), ShmSegmentPath)
    t = _transition(node, epoch=7)
    ShmSegmentPath().allocate(t)
    try:
        assert t.segment == shm.segment_name(node.node_tag, 7, 0)
        assert t.segment in shm.leftovers(node.node_tag)  # named until every source attached it
        assert t.arena is None and tuple(t.new_cache.shape) == SHAPE
        assert not t.build.started  # started only once the span agreed
        t.build.wait()  # builds the runner without a cache, then reserves the segment's pages
        assert node.pool.built == [False] and t.build.error == ""
        runner = t.adopt_runner()
        assert runner.kv_cache is t.new_cache
    finally:
        shm.unlink(t.segment)
    assert t.segment not in shm.leftovers(node.node_tag)


@needs_shm
def test_shm_segment_path_keeps_an_arena_when_this_worker_recycles():
    node = _node("shm", recycle=True, spare=False)
    t = _transition(node, epoch=8)
    ShmSegmentPath().allocate(t)
    try:
        assert t.arena is not None and t.arena.view(SHAPE, torch.float32).data_ptr() == t.new_cache.data_ptr()
    finally:
        t.build.finish()  # never started: given up (its reservation's descriptor closed)
        shm.unlink(t.segment)
        node.arenas.release(t.arena)
        node.reaper.drain()


def test_tcp_path_gives_private_zeros_that_only_the_receiver_writes():
    for node in (_node("tcp", spare=False), _node("shm", shm=False, spare=False)):
        assert isinstance(path_for(node), TcpPath)
        t = _transition(node)
        TcpPath().allocate(t)
        assert t.segment is None and t.arena is None
        assert tuple(t.new_cache.shape) == SHAPE and int(t.new_cache.count_nonzero()) == 0
        assert not t.build.started
        t.build.wait()
        assert node.pool.built == [False] and t.adopt_runner().kv_cache is t.new_cache


def test_p2p_path_builds_the_runner_with_its_own_cache_inside_the_prepare():
    node = _node("p2p", spare=False)
    path = path_for(node)
    assert isinstance(path, P2pPath) and not path.one_sided
    t = _transition(node)
    path.allocate(t)
    assert t.new_cache is None and t.runner is not None and tuple(t.runner.kv_cache.shape) == SHAPE
    assert node.pool.built == [True]


def test_a_failed_build_refuses_through_adopt_runner():
    node = _node("tcp", spare=False)
    t = _transition(node)
    TcpPath().allocate(t)

    def broken(group, with_cache=True):
        raise RuntimeError("no memory for the runner")

    node.pool.runner = broken
    t.build.wait()
    with pytest.raises(RuntimeError, match="no memory for the runner"):
        t.adopt_runner()
