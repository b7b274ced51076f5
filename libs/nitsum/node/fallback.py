"""After a member of the node world died: this worker leaves the world and serves standalone at TP=1
(`leave_world`), and the process groups a dead member may be in are torn down (`drop_communicators`). The worker
shell (`nitsum_services.worker.peer_loss`) decides which, and when."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from nitsum.topology import Group, Topology

if TYPE_CHECKING:
    from nitsum.node.runtime import NodeRuntime


def leave_world(node: NodeRuntime, reason: str) -> list[str]:
    """A collective failed because a worker of the node world is gone. A process world cannot take a
    member back, so this worker serves standalone at TP=1 (as a restarted worker does) and takes part in
    no further collective of this world, until the node is re-formed: a new world generation among the
    same devices (NodeWorld(generation=g)) whose NodeRuntime adopts this TP=1 engine (`engine=`). Returns
    the ids of the requests its engine held and could not keep: the caller re-queues them.

    A TP=1 group holds its requests' whole KV: its runner and engine stay, its requests continue. A
    larger group's KV was sharded over its members, one of which may be dead: a TP=1 runner over the
    same weight store (views: nothing is read or copied) and an empty engine take over. A prepared
    transition is dropped either way (its new cache goes with it, and any KV segment name of this worker
    a failed exchange left in /dev/shm)."""
    assert 1 in node.world.levels, "a fallback to TP=1 needs TP=1 among the node's levels (NITSUM_MIN_TP=1)"
    node.close()
    node.world_lost = reason
    node.leaders = {}  # standalone: a hybrid worker (the TP=1 topology below has no other role)
    old = node.group
    solo = Group(node.rank, 1)
    node.topology = Topology.uniform(node.world.size, 1)
    if old.tp == 1 and node.engine is not None:
        dropped = []
        node.engine.set_role("hybrid")  # what it holds finishes as it started (a prefill pins only at a first token)
    else:
        dropped = sorted(node.engine.request_ids()) if node.engine is not None else []
        node.runner = node.pool.runner(solo)
        node.engine = node.new_engine(solo, node.runner)
    drop_communicators(node, keep=None)
    return dropped


def drop_communicators(node: NodeRuntime, keep: Group | None) -> int:
    """After a peer loss: tear down this worker's pre-built process groups, all but `keep`'s. A member still
    waiting in a collective of one of them (gloo: the dead worker's ring neighbour waits for data that never
    comes) then fails at once ("connection closed") instead of at the world timeout. gloo closes a group's
    connections only when its last reference goes: the caller drops what it held (a failed prepare's
    runner, the traceback) first; the runners built ahead for other levels hold their groups too (a TP=1
    runner holds none), so the pool forgets them. Returns how many groups went."""
    doomed = node.world.communicator_keys(keep=(keep.start, keep.tp) if keep is not None else None)
    node.pool.forget(doomed)
    for key in doomed:
        node.world.drop_group(*key)
    gc.collect()  # runners and engines of a failed step may sit in reference cycles
    return len(doomed)
