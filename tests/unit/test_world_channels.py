"""A node world's groups get shared-memory collectives when their members share a host
(NodeWorld.attach_channels): two real processes in a real gloo world. The channel carries the TP group's
collectives and the world's all-gathers; members on different "hosts" keep gloo; no segment name stays in
/dev/shm; dropping a group's channel makes a member waiting in it raise."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from nitsum.natsserver import free_port
from nitsum.parallel import shm_collectives as sc

pytestmark = [
    pytest.mark.skipif(not sc.supported(), reason="shared-memory collectives need x86-64 Linux"),
    pytest.mark.timeout(120),
]


def _member(rank, port, same_host, out):
    from nitsum.parallel.world import NodeWorld

    torch.set_num_threads(1)
    world = NodeWorld(rank, 2, "127.0.0.1", port, timeout_s=20)
    res = {"made": world.attach_channels(lambda ranks: same_host)}
    group = world.group(0, 2)
    res["channel"] = group.channel is not None
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    res["sum"] = group.all_reduce(x).tolist()
    # (After a collective: the creator unlinks the name right after the set-up's last exchange, which the
    # other member may leave first; it cannot leave this one before the creator came to it.)
    res["names"] = sorted(n for n in os.listdir(sc.SHM_DIR) if n.startswith(f"{sc.NAME_PREFIX}p{port}-"))
    res["gather"] = group.all_gather(torch.full((2, 1), float(rank)), dim=-1).tolist()
    res["plan"] = group.broadcast_bytes(b"step-plan" if rank == 0 else None)
    res["parts"] = world.all_gather_bytes(b"m" * (rank + 1), 0, 2)
    res["rounds"] = group.channel.rounds if group.channel is not None else 0
    if same_host:
        if rank == 1:
            world.drop_channel(0, 2)  # as a peer loss tears a group down
        else:
            try:
                group.all_reduce(torch.ones(2))
                res["after_drop"] = "no error"
            except sc.ChannelError as exc:
                res["after_drop"] = str(exc)
    world.destroy()
    out.put((rank, res))


def _world(same_host: bool) -> dict:
    ctx = mp.get_context("fork")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_member, args=(r, port, same_host, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


def test_same_host_groups_run_their_collectives_through_shared_memory():
    res = _world(True)
    for rank in (0, 1):
        r = res[rank]
        assert r["made"] == 1 and r["channel"] and r["names"] == []  # mapped by both, then unlinked
        assert r["sum"] == [3.0 * i for i in range(6)]
        assert r["gather"] == [[0.0, 1.0], [0.0, 1.0]]
        assert r["plan"] == b"step-plan" and r["parts"] == [b"m", b"mm"]
        assert r["rounds"] == 4  # each of the four collectives was one round of the channel, none went to gloo
    assert "torn down" in res[0]["after_drop"]


def test_members_on_different_hosts_keep_gloo():
    res = _world(False)
    for rank in (0, 1):
        r = res[rank]
        assert r["made"] == 0 and not r["channel"] and r["rounds"] == 0
        assert r["sum"] == [3.0 * i for i in range(6)] and r["parts"] == [b"m", b"mm"] and r["plan"] == b"step-plan"
