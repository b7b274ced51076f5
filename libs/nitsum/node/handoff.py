"""P/D hand-offs between two groups of one node world, by the KV path a TP change uses.

A prefill group's leader pins a request after its first token; the worker shell asks a decode group's
leader for blocks (`reserve`, in that leader's step thread) and for its members' arena handles
(`group_handles`: the decode group all-gathers them once per epoch). Then, at a step boundary of the
prefill group, `send` broadcasts a `handoff` command: every member of the prefill group maps the decode
members' caches (shm arenas, through /proc/<pid>/fd like a transition's new caches) and writes its heads of
the request's blocks into the reserved ones (`copy_transfers_one_sided`, the commit delta's copy), and the
group agrees that every write landed. Only then does the decode leader `adopt` the request. The decode
group's steps never wait: the reserved blocks belong to no running request until the adoption.

Everything here runs in the step thread of the worker it is called on (a leader between steps, a peer while
following its leader's plans).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nitsum.engine import migration
from nitsum.kv.reshard import handoff_transfers
from nitsum.node.messages import NodeCommand, TransitionAck
from nitsum.node.precopy import copy_transfers_one_sided
from nitsum.topology import Group
from nitsum.transfer import shm
from nitsum.wire import codec
from nitsum.wire.node import Agreement

if TYPE_CHECKING:
    from nitsum.node.runtime import NodeRuntime


class HandoffError(Exception):
    """The hand-off cannot be done (why is the message); nothing was adopted."""


class NoRoom(HandoffError):
    """The decode group's KV pool has no room for the request now."""


class NotPinned(HandoffError):
    """The request is no longer waiting for its hand-off here: a TP change moved it (it decodes on in its new
    group, which streams it) or it went (aborted)."""


def own_handle(node: NodeRuntime) -> str:
    """The handle of the arena behind this worker's cache in use ("" when it is private memory)."""
    arena = node.arenas.in_use
    return arena.handle if arena is not None and arena.fd is not None else ""


def gather_handles(node: NodeRuntime) -> tuple[str, ...]:
    """Every member of this worker's group, in member order: its cache's arena handle (a group all-gather)."""
    g = node.group
    mine = own_handle(node).encode()
    if g.tp == 1:
        return (mine.decode(),)
    parts = node.world.all_gather_bytes(mine, g.start, g.tp)
    return tuple(p.decode() for p in parts)


def group_handles(node: NodeRuntime) -> tuple[str, ...]:
    """Leader: its group's arena handles, gathered once per epoch (a commit may switch arenas)."""
    assert node.is_leader, "the leader answers for its group"
    cached = node.handoff_handles
    if cached is not None and cached[0] == node.epoch:
        return cached[1]
    if node.group.tp > 1:
        node.broadcast(NodeCommand("handles", node.epoch))
    handles = gather_handles(node)
    node.handoff_handles = (node.epoch, handles)
    return handles


def reserve(node: NodeRuntime, request_id: str, num_tokens: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Decode leader: (blocks reserved for the request, its group's arena handles). HandoffError when this
    group cannot take it (not a decode-capable leader, not on shared memory, no room)."""
    if node.engine is None:
        raise HandoffError(f"worker {node.rank} is not a group leader")
    if node.engine.role == "prefill":
        raise HandoffError(f"group {node.group} is a prefill group")
    if node.in_transition:
        # Its reservation would not move with the change, and the change may recycle the arena written into.
        raise HandoffError(f"a TP change of epoch {node.prepared_epoch} is in progress on worker {node.rank}")
    if node.kv_path != "shm":
        raise HandoffError(f"hand-offs inside a node world need its shm KV path (this world's is {node.kv_path})")
    handles = group_handles(node)
    if not all(handles):
        raise HandoffError(f"group {node.group} has members whose cache is not a shared arena")
    blocks = node.engine.reserve_handoff(request_id, num_tokens)
    if blocks is None:
        raise NoRoom(f"group {node.group} has no room for {num_tokens} KV tokens now")
    return tuple(blocks), handles


def source(node: NodeRuntime, request_id: str) -> tuple[dict, int, list[int]]:
    """Prefill leader: the pinned request's (state, KV tokens, blocks); NotPinned when it is not pinned here."""
    if node.engine is None:
        raise NotPinned(f"worker {node.rank} is no longer a group leader")
    try:
        state, num_tokens, blocks = node.engine.handoff_source(request_id)
    except KeyError:
        raise NotPinned(f"request {request_id} is no longer held here") from None
    if state["status"] != "pinned":
        raise NotPinned(f"request {request_id} decodes on here (a TP change moved it)")
    return state, num_tokens, blocks


def send(node: NodeRuntime, cmd: NodeCommand) -> int:
    """Prefill leader: run the hand-off's copy on every member of the group; the bytes this worker wrote.
    HandoffError when some member's writes did not all land (the group agrees on it)."""
    assert cmd.kind == "handoff" and node.is_leader
    node.broadcast(cmd)
    ack = copy(node, cmd)
    if not ack.ok:
        raise HandoffError(ack.reason)
    return ack.bytes_moved


def copy(node: NodeRuntime, cmd: NodeCommand) -> TransitionAck:
    """Every member of the prefill group: write this worker's heads of the request's blocks into the decode
    members' caches, then agree with the group that all writes landed."""
    (start, tp) = cmd.groups[0]
    dst, src = Group(start, tp), node.group
    problem, moved = "", 0
    try:
        transfers = [
            t
            for t in handoff_transfers(src, dst, cmd.blocks, cmd.dst_blocks, node.layout.geometry)
            if t.src_worker == node.rank
        ]
        caches = {}
        for t in transfers:
            if t.dst_worker not in caches:
                position = t.dst_worker - dst.start
                cache = shm.attach_handle(
                    cmd.handles[position],
                    node.layout.cache_shape(dst.tp),
                    node.layout.dtype,
                    node.members[t.dst_worker].pid,
                )
                heads = migration.heads_of(node.layout.model_config.num_kv_heads, dst, t.dst_worker)
                caches[t.dst_worker] = (cache, heads)
        heads = migration.heads_of(node.layout.model_config.num_kv_heads, src, node.rank)
        by_path, problem = copy_transfers_one_sided(node.rank, transfers, node.runner.kv_cache, heads, caches)
        moved = sum(by_path.values())
        caches.clear()  # the mappings go now
    except (OSError, RuntimeError, IndexError, ValueError) as exc:
        problem = f"worker {node.rank}: {type(exc).__name__}: {exc}"
    if src.tp > 1:
        parts = node.world.all_gather_bytes(codec.encode(Agreement(problem)), src.start, src.tp)
        problem = "; ".join(a.problem for a in (codec.decode(p, Agreement) for p in parts) if a.problem)
    node.counters.bytes_by_path["shm"] += moved
    return TransitionAck(node.epoch, not problem, "handoff", problem, 0.0, moved)


def adopt(node: NodeRuntime, state: dict, num_tokens: int) -> None:
    """Decode leader: the request decodes here from its first token (its KV is in the reserved blocks)."""
    if node.engine is None:
        raise HandoffError(f"worker {node.rank} is not a group leader (its group changed meanwhile)")
    node.engine.adopt_handoff(state, num_tokens)


def drop(node: NodeRuntime, request_id: str) -> bool:
    """Decode leader: a reservation whose hand-off failed or expired goes."""
    return node.engine.drop_handoff(request_id) if node.engine is not None else False
