"""A P/D hand-off between two groups of a node world (`nitsum.node.handoff`), one worker at a time: the source
member's heads of the request's blocks land in the reserved blocks of real shared-memory arenas mapped by
their /proc handles (this process's own, so no second process is needed); a TP2 source group agrees on the
outcome through the world (a scripted all-gather answers for the other member); a bad handle is a refusal
the group agrees on, and nothing else is written. Also the roles a node-world prepare carries (wire)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from nitsum.kv.reshard import KVGeometry
from nitsum.node import handoff
from nitsum.node.counters import KvCounters
from nitsum.topology import Group, Topology
from nitsum.transfer import shm
from nitsum.wire import codec
from nitsum.wire.node import Agreement, NodeCommand

LAYERS, HEADS, BLOCKS, BS, DIM = 2, 4, 8, 4, 3


def shape(tp: int) -> tuple[int, ...]:
    return (LAYERS, 2, BLOCKS, BS, HEADS // tp, DIM)


class _World:
    def __init__(self, others: list) -> None:
        self.others, self.gathers = others, []

    def all_gather_bytes(self, payload: bytes, start: int, tp: int) -> list[bytes]:
        self.gathers.append((start, tp))
        return [payload] + [codec.encode(m) for m in self.others[: tp - 1]]


def _node(rank: int, group: Group, cache: torch.Tensor, others: list | None = None):
    return SimpleNamespace(
        rank=rank,
        group=group,
        epoch=3,
        world=_World(others or []),
        layout=SimpleNamespace(
            geometry=KVGeometry(LAYERS, HEADS, BS),
            cache_shape=shape,
            dtype=torch.float32,
            model_config=SimpleNamespace(num_kv_heads=HEADS),
        ),
        members=[SimpleNamespace(pid=os.getpid())] * 4,
        runner=SimpleNamespace(kv_cache=cache),
        counters=KvCounters(),
    )


@pytest.fixture
def arenas(tmp_path):
    made = [shm.Arena.create(f"{shm.SEGMENT_PREFIX}test-handoff-{os.getpid()}-{i}", 1 << 16) for i in range(2)]
    yield made
    for arena in made:
        arena.close()


def test_a_tp1_prefill_worker_writes_each_decode_member_its_heads_of_the_reserved_blocks(arenas):
    src = torch.randn(shape(1))
    node = _node(0, Group(0, 1), src)
    dst = [a.view(shape(2), torch.float32) for a in arenas]
    for cache in dst:
        cache.zero_()
    cmd = NodeCommand(
        "handoff",
        3,
        groups=((2, 2),),
        request_id="r",
        blocks=(5, 1),
        dst_blocks=(0, 6),
        handles=tuple(a.handle for a in arenas),
    )
    ack = handoff.copy(node, cmd)
    assert ack.ok and ack.phase == "handoff", ack
    for position, cache in enumerate(dst):
        heads = slice(position * 2, position * 2 + 2)
        assert torch.equal(cache[:, :, 0], src[:, :, 5, :, heads])
        assert torch.equal(cache[:, :, 6], src[:, :, 1, :, heads])
        untouched = [b for b in range(BLOCKS) if b not in (0, 6)]
        assert not cache[:, :, untouched].any()  # nothing but the reserved blocks is written
    assert ack.bytes_moved == 2 * 2 * LAYERS * 2 * BS * 2 * DIM * 4
    assert node.world.gathers == []  # a TP1 group has nobody to agree with


def test_a_tp2_prefill_member_writes_its_own_heads_and_the_group_agrees(arenas):
    src = torch.randn(shape(2))  # member 1 of [0-1 TP2]: heads 2, 3
    node = _node(1, Group(0, 2), src, others=[Agreement("")])
    dst = arenas[0].view(shape(1), torch.float32)
    dst.zero_()
    cmd = NodeCommand(
        "handoff", 3, groups=((2, 1),), request_id="r", blocks=(3,), dst_blocks=(7,), handles=(arenas[0].handle,)
    )
    ack = handoff.copy(node, cmd)
    assert ack.ok, ack
    assert torch.equal(dst[:, :, 7, :, 2:4], src[:, :, 3])
    assert not dst[:, :, 7, :, 0:2].any()  # heads 0, 1 are member 0's to write
    assert node.world.gathers == [(0, 2)]


def test_a_member_that_cannot_map_the_destination_refuses_for_the_whole_group(arenas):
    src = torch.randn(shape(2))
    node = _node(0, Group(0, 2), src, others=[Agreement("")])
    cmd = NodeCommand(
        "handoff", 3, groups=((2, 1),), request_id="r", blocks=(3,), dst_blocks=(7,), handles=("/etc/passwd",)
    )
    ack = handoff.copy(node, cmd)
    assert not ack.ok and "not a KV arena handle" in ack.reason
    # The other member's problem alone also refuses this one's ack.
    node = _node(0, Group(0, 2), src, others=[Agreement("worker 1: OSError: gone")])
    cmd = NodeCommand(
        "handoff", 3, groups=((2, 1),), request_id="r", blocks=(3,), dst_blocks=(7,), handles=(arenas[0].handle,)
    )
    assert handoff.copy(node, cmd).reason == "worker 1: OSError: gone"


def test_node_commands_carry_one_role_and_leader_per_group_and_refuse_bad_ones():
    cmd = NodeCommand("prepare", 4, groups=((0, 2), (2, 2)), roles=("prefill", "decode"), leaders=("w0", "w2"))
    assert NodeCommand.decode(cmd.encode()) == cmd
    assert Topology.of(4, cmd.groups).group_of(3) == Group(2, 2)
    with pytest.raises(ValueError, match="one per group"):
        NodeCommand("prepare", 4, groups=((0, 2), (2, 2)), roles=("prefill",))
    with pytest.raises(ValueError, match="unknown role"):
        NodeCommand("prepare", 4, groups=((0, 4),), roles=("both",))
    with pytest.raises(ValueError, match="destination"):
        NodeCommand("handoff", 4, groups=((2, 2),), blocks=(1, 2), dst_blocks=(3,))


def test_a_request_no_longer_pinned_here_is_not_handed_off():
    def engine(status: str | None):
        def handoff_source(rid):
            if status is None:
                raise KeyError(rid)
            return {"id": rid, "status": status}, 9, [4, 5, 6]

        return SimpleNamespace(handoff_source=handoff_source)

    node = SimpleNamespace(rank=0, engine=engine("pinned"))
    assert handoff.source(node, "r") == ({"id": "r", "status": "pinned"}, 9, [4, 5, 6])
    for gone in (engine("running"), engine(None), None):  # moved into this engine's new group, moved away, a peer
        node.engine = gone
        with pytest.raises(handoff.NotPinned):
            handoff.source(node, "r")
