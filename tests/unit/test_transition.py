"""One epoch's `Transition` and its `PreCopyGate`, without a node world: the node is a stand-in and the span's
exchanges answer from a scripted list of the other members' messages (encoded by wire.codec, as on the
world). Checks who takes part, how a refusal anywhere in the span refuses the epoch and leaves nothing, and
that the final prepare ack passes the gate exactly once."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from nitsum.node.build import PageReservations, RunnerBuild
from nitsum.node.commands import refuse_in_span
from nitsum.node.counters import KvCounters
from nitsum.node.gate import PreCopyGate
from nitsum.node.messages import TransitionAck
from nitsum.node.transition import Transition
from nitsum.topology import Group, Topology
from nitsum.wire import codec
from nitsum.wire.node import PrepareShare

SHAPE = (2, 2, 4, 4, 1, 8)


class _World:
    """Answers each all-gather with this worker's payload followed by the others' scripted messages."""

    def __init__(self, others: list) -> None:
        self.others = others
        self.gathers: list[tuple[int, int]] = []

    def all_gather_bytes(self, payload: bytes, start: int, tp: int) -> list[bytes]:
        self.gathers.append((start, tp))
        return [payload] + [codec.encode(m) for m in self.others[: tp - 1]]


class _Runner:
    kv_cache_shape = SHAPE

    def __init__(self) -> None:
        self.kv_cache = None


def _node(topology: Topology, rank: int = 0, others: list | None = None):
    pool = SimpleNamespace(runner=lambda group, with_cache=True: _Runner(), pooled=lambda group: None, shelved=[])
    pool.shelve = pool.shelved.append
    node = SimpleNamespace(
        rank=rank,
        topology=topology,
        epoch=2,
        kv_path="tcp",
        members=[SimpleNamespace(shm=False)] * 4,
        world=_World(others or []),
        failure_hook=None,
        transition=None,
        prepare_done=None,
        receiver=None,
        layout=SimpleNamespace(cache_shape=lambda tp: SHAPE, dtype=torch.float32),
        counters=KvCounters(),
        reserving=PageReservations(rank),
        reaper=SimpleNamespace(retired=[]),
        pool=pool,
        engine=None,
        last_prepare_timings_ms={},
        last_commit_timings_ms={},
        is_leader=True,
    )
    node.reaper.retire = lambda own=(), mapped=(), other=(): node.reaper.retired.append((list(own), list(mapped)))
    node.kv_path_of = lambda src, dst: "local" if src == dst else "shm"
    node.kv_snapshot = lambda group: []
    return node


def test_a_worker_outside_the_change_only_advances_its_epoch_and_topology():
    old = Topology.of(4, ((0, 2), (2, 2)))
    new = Topology.of(4, ((0, 2), (2, 1), (3, 1)))  # only the second group splits
    node = _node(old, rank=0)
    t = node.transition = Transition(node, 3, new, time.perf_counter())
    assert t.span is None and t.acked and not t.gate.pending
    ack = t.prepare()
    assert (ack.ok, ack.phase, ack.reason) == (True, "prepare", "not affected")
    assert node.world.gathers == []  # a bystander takes part in no exchange
    ack = t.commit()
    assert ack.ok and ack.phase == "commit" and ack.bytes_moved == 0
    assert (node.topology, node.epoch, node.transition) == (new, 3, None)


def test_a_refusal_by_another_member_refuses_the_epoch_and_leaves_nothing():
    old = Topology.of(4, ((0, 1), (1, 1), (2, 2)))
    new = Topology.of(4, ((0, 2), (2, 2)))  # workers 0 and 1 merge
    node = _node(old, rank=0, others=[PrepareShare(False, "worker 1: MemoryError: no room")])
    t = node.transition = Transition(node, 3, new, time.perf_counter())
    assert t.span == Group(0, 2) and t.source and t.destination
    ack = t.prepare()
    assert (ack.ok, ack.phase, ack.reason) == (False, "prepare", "worker 1: MemoryError: no room")
    assert node.world.gathers == [(0, 2)]  # this worker still took part in the span's exchange
    assert node.transition is None and t.new_cache is None and t.acked
    assert (node.topology, node.epoch) == (old, 2)  # the old topology keeps serving


def test_refuse_in_span_joins_the_exchange_and_reports_every_refusal():
    old = Topology.of(4, ((0, 1), (1, 1), (2, 2)))
    new = Topology.of(4, ((0, 2), (2, 2)))
    node = _node(old, rank=0, others=[PrepareShare(False, "worker 1: epoch 2 is in progress")])
    ack = refuse_in_span(node, 3, new, "epoch 2 is in progress", time.perf_counter())
    assert not ack.ok and ack.reason == "worker 0: epoch 2 is in progress; worker 1: epoch 2 is in progress"
    outside = _node(old, rank=2)
    ack = refuse_in_span(outside, 3, new, "busy", time.perf_counter())
    assert not ack.ok and ack.reason == "busy" and outside.world.gathers == []


class _PreCopy:
    def __init__(self, chunks: int) -> None:
        self.left, self.bytes_sent, self.error = chunks, 0, ""
        self.bytes_by_path = {"shm": 0, "tcp": 0}

    @property
    def complete(self) -> bool:
        return self.left == 0

    def run(self, chunks, classes) -> int:
        self.left -= len(chunks)
        self.bytes_sent += 100 * len(chunks)
        self.bytes_by_path["shm"] += 100 * len(chunks)
        return 100 * len(chunks)

    def finish_mine(self) -> None:
        self.run([None] * self.left, {})


def _gated(chunks: int, build: RunnerBuild | None = None):
    node = SimpleNamespace(prepare_done=None, rank=0, counters=KvCounters())
    t = SimpleNamespace(
        node=node, span=Group(0, 2), acked=False, precopy=_PreCopy(chunks), build=build, epoch=5, t0=time.perf_counter()
    )
    return t, PreCopyGate(t)


def test_the_final_prepare_ack_passes_the_gate_once_when_every_chunk_is_done():
    t, gate = _gated(2)
    assert gate.pending
    assert gate.run([(0, 0)], {}) == 100 and t.node.prepare_done is None and gate.pending
    assert gate.run([(0, 1)], {}) == 100
    ack = t.node.prepare_done
    assert isinstance(ack, TransitionAck) and (ack.ok, ack.phase, ack.epoch, ack.bytes_moved) == (
        True,
        "prepare",
        5,
        200,
    )
    assert dict(ack.bytes_by_path) == {"shm": 200, "tcp": 0} and t.node.counters.bytes_by_path["shm"] == 200
    t.node.prepare_done = None
    gate.finish(force=True)
    assert t.node.prepare_done is None and not gate.pending  # once only


def test_the_gate_waits_for_the_new_runner_unless_forced():
    build = RunnerBuild(lambda: "runner", start=False)
    t, gate = _gated(1, build)
    gate.run([(0, 0)], {})
    assert t.node.prepare_done is None  # every chunk is done, but the runner is not built yet
    gate.poll(wait_s=5.0)  # starts and waits for the build
    assert t.node.prepare_done is not None and t.node.prepare_done.ok


def test_an_abort_during_pre_copy_answers_the_prepare_as_failed():
    t, gate = _gated(3)
    gate.run([(0, 0)], {})
    gate.finish(force=True, reason="aborted during pre-copy")
    ack = t.node.prepare_done
    assert (ack.ok, ack.reason, ack.bytes_moved) == (False, "aborted during pre-copy", 100)


def test_a_failed_link_fails_the_final_ack_with_its_error():
    t, gate = _gated(1)
    t.precopy.error = "worker 0: link to worker 1 broke"
    gate.run([(0, 0)], {})
    assert (t.node.prepare_done.ok, t.node.prepare_done.reason) == (False, "worker 0: link to worker 1 broke")
