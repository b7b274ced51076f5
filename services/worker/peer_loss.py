"""The worker's defence against the death of another worker of its node world (issue 4: a worker that
dies mid-transition), and its way back in. `PeerLossGuard` wraps the node backend's calls that run
collectives; see its docstring for what a survivor does. Built by services/worker/main.py for every
node-world worker.

Re-formation: once every device of the node is back (the dead one restarted in standby, NITSUM_NODE_STANDBY)
the coordinator sends `NodeReform(node_id, generation, size)` to all of them. A worker at TP=1 that is not in
a transition (`reform_refusal` says why not otherwise) builds world generation `generation` in a background
thread (`form_generation`: the old world goes, the new one's rendezvous waits for every member, bounded by
NITSUM_WORLD_TIMEOUT_S) and a NodeRuntime that adopts the engine it serves with; the worker shell swaps it in
at a step boundary. Requests keep running throughout (a TP=1 engine uses no communicator)."""

from __future__ import annotations

import logging
import sys
import traceback

from nitsum.node import fallback
from nitsum_services.worker.backend import NodeBackend

log = logging.getLogger("nitsum.worker")


class PeerLossGuard(NodeBackend):
    """A node-world backend that survives the death of another worker of the node.

    A collective with a dead member fails at once ("connection closed by peer") or at the world timeout.
    Nothing here hangs or crash-loops on it; what happens next depends on where it failed:
    - in a transition (a prepare/commit/abort command, as leader or as a peer following one): the failed
      exchange spanned other groups; if this worker's own group still answers a check on its own
      communicator (a separate process group, untouched by the failure), the group keeps serving its
      requests in the old topology and refuses further transitions, but a split of itself (`local_change`:
      the coordinator splits it to TP=1 before it re-forms the node's world, which takes TP=1 workers only);
      otherwise, or at TP=1,
    - anywhere else (a step, a keepalive) or when the check fails: the worker leaves the node world
      (nitsum.node.fallback.leave_world): at TP=1 it keeps its engine and requests; a larger group's leader gets an
      empty TP=1 engine over the same weights and the requests it held are re-queued (`on_dropped`:
      the session ends their streams with the retryable `worker_lost`, the gateway re-submits them with
      the tokens already streamed).
    Either way TP changes on the node stop until the coordinator re-forms its world (module docstring).
    """

    def __init__(self, runtime, model_name: str, max_model_len: int) -> None:
        super().__init__(runtime, model_name, max_model_len)
        # Called from the step thread with (request ids, why) for the requests the engine lost.
        self.on_dropped = lambda request_ids, why: None

    @property
    def in_world(self) -> bool:
        # A group that kept serving after a failed transition is still one of the world's groups (it takes
        # no KV hand-offs); a worker that fell back to TP=1 is a standalone worker now.
        return not self.runtime.world_lost or self.runtime.group.tp > 1

    @property
    def engine(self):
        return self.runtime.engine

    def refusal(self, kind: str, epoch: int, groups: tuple = ()) -> str:
        """Why this leader refuses a topology command now ("" when it takes it). After the world lost a member
        only changes inside this worker's own (whole) group pass: an abort (it touches nothing but this group's
        prepared state), a split of the group (`local_change`) and the commit of such a split."""
        lost = self.runtime.world_lost
        if not lost or kind == "abort":
            return ""
        if kind == "prepare" and self.local_change(groups) is not None:
            return ""
        if kind == "commit" and self.runtime.prepared_epoch == epoch:
            return ""  # only a local change is ever prepared here once the world lost a member
        return f"this worker's node world lost a member ({lost}): TP cannot change here until the node is re-formed"

    def local_change(self, groups: tuple):
        """`local_change` of this worker's topology and group (see the function)."""
        return local_change(self.runtime.topology, self.runtime.group, groups)

    def command(self, cmd):
        from nitsum.node.runtime import NodeCommand, TransitionAck

        why = self.refusal(cmd.kind, cmd.epoch, cmd.groups)
        if why:
            return TransitionAck(cmd.epoch, False, cmd.kind, why)
        if self.runtime.world_lost and cmd.kind == "prepare":
            cmd = NodeCommand(cmd.kind, cmd.epoch, self.local_change(cmd.groups))  # what the peers get too
        try:
            return super().command(cmd)
        except Exception as exc:  # a collective of the transition failed (a peer died or timed out)
            why = f"{cmd.kind} of epoch {cmd.epoch} failed: {_describe(exc)}"
        # Handled outside the except block: its traceback holds the failed prepare's frames (and through them
        # the process group to tear down, which gloo closes only once nothing refers to it).
        self._after_failure(why, in_transition=True)
        return TransitionAck(cmd.epoch, False, cmd.kind, why)

    def follow(self) -> str:
        try:
            return super().follow()
        except Exception as exc:  # the leader's broadcast or a transition's exchange failed
            why = f"following the group leader failed: {_describe(exc)}"
        self._after_failure(why, in_transition=True)
        return "noop"

    def step(self):
        if self.runtime.group.tp == 1:
            return super().step()  # no collective: an engine failure is the session's to report
        try:
            return super().step()
        except Exception as exc:  # a step collective failed: the group is out of lockstep for good
            why = f"a TP step failed: {_describe(exc)}"
        self._after_failure(why, in_transition=False)
        return []

    def idle_tick(self) -> None:
        try:
            super().idle_tick()
            return
        except Exception as exc:  # the keepalive broadcast failed: a peer is gone
            why = f"keepalive failed: {_describe(exc)}"
        self._after_failure(why, in_transition=False)

    def _after_failure(self, why: str, in_transition: bool) -> None:
        """What this worker does after a failed collective (also called by NodeBackend for the exchange and
        pre-copy rounds it runs between steps, from inside their except blocks)."""
        failing = sys.exc_info()[2]
        if failing is not None:
            # The failed frames' locals (the collective's process group among them) would outlive the
            # teardown below; finished frames can be cleared, the running ones are skipped.
            traceback.clear_frames(failing)
        del failing
        runtime = self.runtime
        group = runtime.group
        log.error("node world collective failed (group %s, epoch %d): %s", group, runtime.epoch, why)
        runtime.close()  # whatever the failed transition prepared goes (KV segment names too)
        # Every other group this worker is in goes now: whoever still waits in one of them (the failed
        # exchange's ring) fails at once rather than at the world timeout, and reaches its own check.
        fallback.drop_communicators(runtime, keep=group if group.tp > 1 else None)
        if in_transition and group.tp > 1 and self._group_answers(group):
            runtime.world_lost = why
            log.warning(
                "group %s is whole: it keeps serving at TP=%d; no more TP changes on this node", group, group.tp
            )
            return
        dropped = fallback.leave_world(runtime, why)
        log.warning("left the node world: serving standalone at TP=1; %d request(s) to re-queue", len(dropped))
        if dropped:
            self.on_dropped(dropped, why)

    def _group_answers(self, group) -> bool:
        """Every member of this group exchanges a token on the group's own communicator (bounded by the
        world timeout); the members reach this check from the same failed command, leader and peers alike."""
        try:
            return len(self.runtime.world.all_gather_bytes(b"alive", group.start, group.tp)) == group.tp
        except Exception as exc:  # a member is gone
            log.warning("group %s check failed: %s", group, _first_line(exc))
            return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}"


def local_change(topology, own, groups: tuple) -> tuple | None:
    """The command's groups ((start, tp) pairs) with every device outside group `own` as `topology` (this
    worker's last view) has it, when the change asked for stays inside `own` (its span is then `own`, whose
    own communicator still works); None otherwise (or when `own` is TP=1: nothing to split). The coordinator
    splits a surviving group this way before it re-forms the node's world; its view of the other devices
    (fallen back, restarted) may differ from this worker's."""
    if own.tp == 1:
        return None
    end = own.start + own.tp
    inside = [(start, tp) for start, tp in groups if own.start <= start < end]
    if any(start + tp > end for start, tp in inside) or sum(tp for _s, tp in inside) != own.tp:
        return None
    outside = [(g.start, g.tp) for g in topology.groups if not own.start <= g.start < end]
    return tuple(sorted(outside + inside))


def reform_refusal(backend, node_id: str, node_size: int, msg, busy: bool) -> str:
    """Why this worker cannot join generation `msg.generation` of its node's world now ("" when it can)."""
    if msg.node_id != node_id:
        return f"this worker belongs to node {node_id!r}, not {msg.node_id!r}"
    if node_size <= 1:
        return "this worker is not part of a node world (NITSUM_NODE_SIZE is 0)"
    if msg.size != node_size:
        return f"this worker's node has {node_size} workers (NITSUM_NODE_SIZE), the re-formation asks for {msg.size}"
    if busy:
        return "a re-formation is already running on this worker"
    if msg.generation <= backend.generation:
        return f"generation {msg.generation} is not newer than this worker's world (generation {backend.generation})"
    start, tp = backend.group
    if tp != 1:
        return (
            f"this worker serves in a TP={tp} group (devices {start}-{start + tp - 1}) that kept serving after the "
            "loss: only TP=1 workers join a re-formed world"
        )
    if isinstance(backend, NodeBackend) and (backend.runtime.in_transition or backend.precopy_active):
        return "a TP transition is in progress on this worker"
    return ""


def form_generation(backend, make_world, make_runtime):
    """Background thread: this worker's share of a new world generation. `make_world()` builds the NodeWorld
    (it destroys this process's old world first); `make_runtime(world, cfg, weights, engine, epoch)` the
    NodeRuntime that adopts the backend's TP=1 engine. The backend keeps serving meanwhile: at TP=1 its
    steps run no collective, and the pre-built TP=1 entries it looks up stay. Raises when the rendezvous or
    the runtime's exchange fails; the backend then serves on exactly as before, outside any world."""
    old = backend.runtime if isinstance(backend, NodeBackend) else None
    if old is not None:
        # Whatever groups the old world still has may include the dead member: they go (at TP=1 none is used).
        fallback.drop_communicators(old, keep=None)
        cfg, weights, engine, epoch = old.cfg, old.weights, old.engine, old.epoch
    else:
        cfg, weights, engine, epoch = backend.cfg, backend.weights, backend.engine, backend.epoch
    assert engine is not None, "a TP=1 worker leads its group and owns an engine"
    world = None
    try:
        world = make_world()
        return make_runtime(world, cfg, weights, engine, epoch)
    except BaseException as exc:
        if world is not None:
            world.destroy()
        if old is not None and not old.world_lost:
            # Its old world is gone too now (destroyed to make room for the new one).
            old.world_lost = f"re-formation failed: {_describe(exc)}"
        raise
