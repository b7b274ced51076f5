"""A TP>1 group's KV as one cache (`nitsum.node.spread_kv`): a full-head tensor split over a group's members by
`heads_of` and gathered back is identical (GQA replication included: each head read once, written to every
member holding it); only the named blocks are touched; a head no member holds is an error. And the round trip
through real shared-memory arenas mapped by their /proc handles, as a TP2 leader maps its peer's cache."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from nitsum.engine.migration import KVExport, heads_of
from nitsum.node import spread_kv
from nitsum.topology import Group
from nitsum.transfer import shm

LAYERS, BLOCKS, BS, DIM = 2, 8, 4, 3


def _split(num_kv_heads: int, tp: int) -> list[spread_kv.Part]:
    """Every member's (heads, blank cache) of a TP=`tp` group: [layers, 2, blocks, bs, local heads, dim]."""
    g = Group(0, tp)
    parts = []
    for w in range(tp):
        h0, h1 = heads_of(num_kv_heads, g, w)
        parts.append(((h0, h1), torch.zeros(LAYERS, 2, BLOCKS, BS, h1 - h0, DIM)))
    return parts


@pytest.mark.parametrize(("num_kv_heads", "tp"), [(4, 2), (4, 4), (2, 4), (1, 2), (8, 2)])
def test_split_by_heads_of_and_gathered_back_is_identical(num_kv_heads, tp):
    full = torch.randn(LAYERS, 2, 3, BS, num_kv_heads, DIM)
    parts = _split(num_kv_heads, tp)
    blocks = [5, 1, 6]
    spread_kv.scatter_heads(parts, full, blocks)
    for (h0, h1), cache in parts:
        assert torch.equal(cache[:, :, blocks], full[:, :, :, :, h0:h1])
        others = [b for b in range(BLOCKS) if b not in blocks]
        assert not cache[:, :, others].any()  # nothing outside the named blocks
    assert torch.equal(spread_kv.gather_heads(parts, num_kv_heads, blocks), full)


def test_a_replicated_head_is_read_once_from_the_first_member_holding_it():
    num_kv_heads, tp = 2, 4  # GQA: members 0,1 hold head 0, members 2,3 head 1
    full = torch.randn(LAYERS, 2, 2, BS, num_kv_heads, DIM)
    parts = _split(num_kv_heads, tp)
    spread_kv.scatter_heads(parts, full, [0, 1])
    parts[1][1].fill_(7.0)  # a replica that differs is never read
    parts[3][1].fill_(7.0)
    assert torch.equal(spread_kv.gather_heads(parts, num_kv_heads, [0, 1]), full)


def test_positions_pick_the_blocks_written_and_a_missing_head_is_an_error():
    full = torch.randn(LAYERS, 2, 3, BS, 4, DIM)
    parts = _split(4, 2)
    spread_kv.scatter_heads(parts, full, [2, 4], positions=[0, 2])
    assert torch.equal(spread_kv.gather_heads(parts, 4, [2, 4]), full[:, :, [0, 2]])
    with pytest.raises(ValueError, match=r"KV heads \[2, 3\]"):
        spread_kv.gather_heads(parts[:1], 4, [2])


@pytest.fixture
def arena(tmp_path):
    made = shm.Arena.create(f"{shm.SEGMENT_PREFIX}test-spread-{os.getpid()}", 1 << 16)
    yield made
    made.close()


def _leader(own: torch.Tensor, peer_handle: str, kv_path: str = "shm"):
    return SimpleNamespace(
        rank=0,
        group=Group(0, 2),
        is_leader=True,
        kv_path=kv_path,
        epoch=1,
        handoff_handles=(1, ("own", peer_handle)),  # gathered already this epoch
        members=[SimpleNamespace(pid=os.getpid(), shm=True)] * 2,
        layout=SimpleNamespace(
            model_config=SimpleNamespace(num_kv_heads=4),
            cache_shape=lambda tp: (LAYERS, 2, BLOCKS, BS, 4 // tp, DIM),
            dtype=torch.float32,
        ),
        runner=SimpleNamespace(kv_cache=own),
    )


def test_a_tp2_leader_gathers_and_scatters_through_its_peers_arena(arena):
    shape = (LAYERS, 2, BLOCKS, BS, 2, DIM)
    peer = shm.attach_handle(arena.handle, shape, torch.float32, os.getpid())
    peer.zero_()
    node = _leader(torch.zeros(shape), arena.handle)
    full = torch.randn(LAYERS, 2, 2, BS, 4, DIM)
    spread_kv.scatter_heads(spread_kv.group_parts(node), full, [3, 7])
    assert torch.equal(peer[:, :, [3, 7]], full[:, :, :, :, 2:4])  # the peer's heads landed in its arena
    assert torch.equal(spread_kv.gather_heads(spread_kv.group_parts(node), 4, [3, 7]), full)
    with pytest.raises(spread_kv.handoff.HandoffError, match="cannot gather"):
        spread_kv.group_parts(_leader(torch.zeros(shape), arena.handle, kv_path="tcp"))


class _Engine:
    """The decode leader engine's hand-off API, recording what is asked of it."""

    role = "decode"

    def __init__(self, blocks):
        self.blocks, self.calls = blocks, []

    def reserve_handoff(self, rid, num_tokens):
        self.calls.append(("reserve", rid, num_tokens))
        return self.blocks

    def adopt_handoff(self, state, num_tokens):
        self.calls.append(("adopt", state["id"], num_tokens))

    def drop_handoff(self, rid):
        self.calls.append(("drop", rid))
        return True


def _decode_leader(arena, blocks):
    shape = (LAYERS, 2, BLOCKS, BS, 2, DIM)
    node = _leader(torch.zeros(shape), arena.handle)
    node.engine, node.in_transition = _Engine(blocks), False
    return node, shm.attach_handle(arena.handle, shape, torch.float32, os.getpid())


def test_a_tp2_decode_leader_writes_both_members_heads_then_adopts(arena):
    node, peer = _decode_leader(arena, [6, 2])
    full = torch.randn(LAYERS, 2, 2, BS, 4, DIM)
    assert spread_kv.import_request(node, KVExport({"id": "r"}, 20, (0, 4), full))
    assert node.engine.calls == [("reserve", "r", 20), ("adopt", "r", 20)]
    assert torch.equal(node.runner.kv_cache[:, :, [6, 2]], full[:, :, :, :, 0:2])
    assert torch.equal(peer[:, :, [6, 2]], full[:, :, :, :, 2:4])


def test_a_failed_import_drops_the_reservation_and_adopts_nothing(arena):
    node, _ = _decode_leader(arena, [6, 2, 3])  # three blocks reserved for an export of two: refused
    with pytest.raises(ValueError, match="3 blocks reserved"):
        spread_kv.import_request(node, KVExport({"id": "r"}, 20, (0, 4), torch.randn(LAYERS, 2, 2, BS, 4, DIM)))
    assert node.engine.calls == [("reserve", "r", 20), ("drop", "r")]
    with pytest.raises(ValueError, match="not all 4"):  # an export of some heads only is refused before anything
        spread_kv.import_request(node, KVExport({"id": "s"}, 20, (0, 2), torch.randn(LAYERS, 2, 2, BS, 2, DIM)))
    node.engine.blocks = None  # no room: False, nothing adopted
    assert not spread_kv.import_request(node, KVExport({"id": "t"}, 20, (0, 4), torch.randn(LAYERS, 2, 2, BS, 4, DIM)))
    assert node.engine.calls[-1] == ("reserve", "t", 20)


def test_only_a_tp_gt1_leader_on_the_shm_path_can_gather(arena):
    node = _leader(torch.zeros(1), arena.handle)
    assert spread_kv.capable(node)
    for change in ({"kv_path": "p2p"}, {"is_leader": False}, {"group": Group(0, 1)}):
        assert not spread_kv.capable(SimpleNamespace(**{**vars(node), **change})), change
