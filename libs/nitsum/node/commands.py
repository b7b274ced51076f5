"""The topology commands (`NodeCommand` kinds) as this worker runs them at a step boundary: which epoch each may
act on (stale, another in progress, not prepared), a refusal that still takes part in its span's exchange, and
what a commit makes this node's: the epoch's topology, its groups' roles with it, and their leaders.

A leader applies a command and broadcasts it; peers apply it as they follow (`NodeRuntime.command`/`follow`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nitsum.kv.reshard import local_target, transition_span
from nitsum.node.messages import NodeCommand, TransitionAck
from nitsum.node.transition import Transition
from nitsum.topology import Topology
from nitsum.wire import codec
from nitsum.wire.node import PrepareShare

if TYPE_CHECKING:
    from nitsum.node.runtime import NodeRuntime


def apply(node: NodeRuntime, cmd: NodeCommand) -> TransitionAck:
    if cmd.kind == "prepare":
        # The roles ride in the epoch's topology; the leaders (worker ids) wait in its Transition for the commit.
        new = Topology.of(node.world.size, cmd.groups, cmd.roles)
        ack = prepare(node, cmd.epoch, new, dict(zip((tuple(g) for g in cmd.groups), cmd.leaders)))
    elif cmd.kind == "commit":
        ack = commit(node, cmd.epoch)
    elif cmd.kind == "abort":
        ack = abort(node, cmd.epoch)
    elif cmd.kind in ("handles", "handoff"):
        from nitsum.node import handoff

        if cmd.kind == "handles":
            handoff.gather_handles(node)
            ack = TransitionAck(cmd.epoch, True, "handles")
        else:
            ack = handoff.copy(node, cmd)
    else:
        return TransitionAck(cmd.epoch, True, "precopy", "", 0.0, node.run_precopy(cmd))
    node.last_ack = ack
    return ack


def prepare(
    node: NodeRuntime, epoch: int, new: Topology, leaders: dict[tuple[int, int], str] | None = None
) -> TransitionAck:
    t0 = time.perf_counter()
    node.reap_reservations()
    if node.transition is not None and epoch > node.epoch:
        # Its own abort never reached this worker. The span's other members are already waiting in the
        # exchange: join it as a refusal so that all of them refuse the epoch (a refusal that skipped it
        # left them waiting there until the world timeout, then out of the node world).
        return refuse_in_span(node, epoch, new, f"epoch {node.transition.epoch} is in progress", t0)
    node.prepare_done = None  # an earlier epoch's final ack nobody took (a peer's) is stale now
    if epoch <= node.epoch:
        return TransitionAck(epoch, False, "prepare", f"stale epoch {epoch} (committed {node.epoch})")
    node.transition = Transition(node, epoch, new, t0, leaders or {})
    return node.transition.prepare()


def commit(node: NodeRuntime, epoch: int) -> TransitionAck:
    """The prepared epoch's commit; once it holds, a leader's engine follows its group's role (requests it holds
    finish under the rules they started with: a prefill engine only pins at a first token)."""
    if epoch <= node.epoch:
        return TransitionAck(epoch, False, "commit", f"stale epoch {epoch} (committed {node.epoch})")
    if node.transition is None or node.transition.epoch != epoch:
        return TransitionAck(epoch, False, "commit", f"epoch {epoch} was not prepared")
    ack = node.transition.commit()
    if ack.ok and node.engine is not None and node.engine.role != node.role:
        node.engine.set_role(node.role)
    return ack


def abort(node: NodeRuntime, epoch: int) -> TransitionAck:
    # An abort of a later epoch also ends an older prepare still held here (its own abort was lost): the
    # coordinator runs one transition at a time, so it never commits an epoch older than one it has sent.
    if node.transition is not None and node.transition.epoch <= epoch:
        node.transition.abort()
        return TransitionAck(epoch, True, "abort")
    if epoch <= node.epoch:
        return TransitionAck(epoch, False, "abort", f"stale epoch {epoch} (committed {node.epoch})")
    return TransitionAck(epoch, True, "abort", "nothing prepared")


def refuse_in_span(node: NodeRuntime, epoch: int, new: Topology, reason: str, t0: float) -> TransitionAck:
    """Refuse `epoch`, taking part in its span's exchange when this worker is in the span."""
    span = transition_span(node.topology, local_target(node.topology, new, node.rank))
    if span is not None and node.rank in span.workers:
        share = PrepareShare(False, f"worker {node.rank}: {reason}")
        parts = node.world.all_gather_bytes(codec.encode(share), span.start, span.tp)
        reason = "; ".join(s.reason for s in (codec.decode(p, PrepareShare) for p in parts) if not s.ok)
    return TransitionAck(epoch, False, "prepare", reason, (time.perf_counter() - t0) * 1000.0)
