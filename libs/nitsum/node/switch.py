"""The commit's switch on a worker whose group changes: the new runner (and, on the new group's leader, its
engine with the requests adopted) serves from here on; what the old topology used goes to the reaper and the
runner pool, off the pause (see `nitsum.node.reaper`). Both run inside `Transition.commit`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack

from nitsum.engine.runner import ModelRunner
from nitsum.engine.sequence import Status
from nitsum.kv.reshard import ReshardPlan
from nitsum.wire.node import CommitShare

if TYPE_CHECKING:
    from nitsum.node.transition import Transition


def adopt(t: Transition, shares: list[CommitShare], delta: ReshardPlan) -> tuple[ModelRunner, Any]:
    """Roles switch: the new runner is in use, and the new group's leader's engine adopts the requests.
    Returns the retired (runner, engine)."""
    node = t.node
    assert t.runner is not None, "a changed worker built its new runner at prepare"
    retired = (node.runner, node.engine)
    node.runner, node.engine = t.runner, None
    if t.my_new.leader == node.rank:
        ahead, t.engine_ahead = t.engine_ahead, None
        engine = ahead.take(t.runner) if ahead is not None else None
        if engine is None:
            node.engines_at_commit += 1
            engine = node.new_engine(t.my_new, t.runner)
        engine.resume_at_step(max(s.step_id for s in shares))
        placements = {p.request_id: p for p in delta.placements if p.dst_group.span == t.my_new.span}
        states = [st for s in shares for st in msgpack.unpackb(s.states, raw=False) if st["id"] in placements]
        for st in states:
            if st["status"] == Status.PINNED.value:
                # A P/D hand-off the change cut short (its source engine is gone): it decodes on here, and
                # the old leader's hand-off gives up (`nitsum.node.handoff.source` no longer finds it pinned).
                st["status"] = Status.RUNNING.value
        engine.install_states(states, placements)
        # Quick: a fresh pool (the full check walks every block: 3-5 ms of a tiny model's TP4 commit).
        engine.check_integrity(quick=True)
        node.engine = engine
    return retired


def retire(t: Transition, retired: tuple[ModelRunner, Any] | None) -> None:
    """The old cache, the mappings of other workers' new caches and the pre-copy go to the reaper: freeing
    them here (~10-20 ms of page freeing with the GIL held) was part of the pause (see node.reaper). The
    old runner itself waits in the pool for the next change to its level."""
    node = t.node
    old_runner, old_engine = retired if retired is not None else (None, None)
    if t.build is not None and not t.build.done:
        node.reserving.append(t.build)
    own = [old_runner.kv_cache] if old_runner is not None else []
    if retired is not None:
        arena, t.arena = t.arena, None
        if node.arenas.switch(arena):
            own = []  # the old cache's arena is the next change's spare (or released)
    node.reaper.retire(
        own=own,
        mapped=[cache for w, (cache, _) in t.dst_caches.items() if w != node.rank],
        other=[old_engine, t.precopy],
    )
    if old_runner is not None:
        node.pool.shelve(old_runner)
    del old_runner, old_engine, retired
    t.dst_caches.clear()
    t.precopy = None
    t.release_links()
