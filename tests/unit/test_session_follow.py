"""A TP peer's step thread follows its leader's plans in a row (StepThread.turn): steps, pre-copy rounds
and prepares do not go back to the event loop one by one; a commit (a promoted peer starts publishing), a
shutdown or the batch's time limit end the turn. A scripted peer backend stands in for the node runtime."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from nitsum.node.runtime import TransitionAck
from nitsum_services.worker import holds as holds_module
from nitsum_services.worker import step_thread as step_thread_module
from nitsum_services.worker.session import WorkerSession


class _Peer:
    """Answers follow() from a script of (kind, ack or None); becomes leader after a commit that says so."""

    def __init__(self, script, promote_at_commit=False):
        self.script = list(script)
        self.followed: list[str] = []
        self.is_leader = False
        self.promote = promote_at_commit
        self.runtime = SimpleNamespace(last_ack=None)

    def stats(self):
        return SimpleNamespace(num_waiting=0)

    def output_counts(self):
        return {"r1": 7}

    def follow(self) -> str:
        kind, ack = self.script.pop(0)
        self.followed.append(kind)
        if ack is not None:
            self.runtime.last_ack = ack
            if ack.phase == "commit" and ack.ok and self.promote:
                self.is_leader = True
        return kind


def _session(backend) -> WorkerSession:
    return WorkerSession(backend, bus=None, worker_id="w1", metrics=None, tracer=None)


def test_a_peer_follows_steps_rounds_and_a_prepare_in_one_turn_and_stops_at_the_commit():
    prepare = TransitionAck(3, True, "prepare", "", 2.0)
    commit = TransitionAck(3, True, "commit", "", 4.0)
    peer = _Peer(
        [
            ("step", None),
            ("step", None),
            ("control", prepare),
            ("precopy", None),
            ("step", None),
            ("control", commit),
            ("step", None),
        ],
        promote_at_commit=True,
    )
    session = _session(peer)
    outputs, rejected, _stats, acks, kind, calls = session.step_thread.turn()
    assert peer.followed == ["step", "step", "control", "precopy", "step", "control"]  # not the step after
    assert (outputs, rejected, calls, kind) == ([], [], [], "control")
    assert [ack.phase for _, ack in acks] == ["prepare", "commit"]
    assert session.step_thread.held_at_commit == {"r1": 7}  # the promoted peer adopts its streams from here


def test_a_shutdown_or_the_time_limit_ends_a_peer_turn(monkeypatch):
    peer = _Peer([("step", None), ("shutdown", None), ("step", None)])
    assert _session(peer).step_thread.turn()[4] == "shutdown" and peer.followed == ["step", "shutdown"]
    monkeypatch.setattr(step_thread_module, "FOLLOW_BATCH_S", 0.0)  # the loop must get its turn to see a stop
    peer = _Peer([("step", None)] * 3)
    assert _session(peer).step_thread.turn()[4] == "step" and peer.followed == ["step"]
    failed_commit = TransitionAck(4, False, "commit", "span refused", 1.0)
    peer = _Peer([("control", failed_commit), ("step", None)])
    session = _session(peer)
    acks = session.step_thread.turn()[3]
    assert (
        [a.ok for _, a in acks] == [False] and peer.followed == ["control"] and session.step_thread.held_at_commit == {}
    )


def test_no_event_loop_is_needed_for_a_peer_turn():
    # StepThread.turn runs in an executor thread: it must not touch the loop (there is none in that thread).
    peer = _Peer([("step", None), ("shutdown", None)])
    session = _session(peer)
    result = asyncio.run(asyncio.to_thread(session.step_thread.turn))
    assert result[4] == "shutdown"


def test_the_hold_follows_the_steady_step_not_a_few_long_ones():
    """The old group's hold before a commit is a fraction of its steady step: the median of its recent steps.
    A stream's first steps (prefill, first calls) are long; an average kept them for ~25 steps and held a
    4 ms group's steps through a whole merge (no token for 50-60 ms)."""
    session = _session(_Peer([]))
    assert session.holds.steady_step_ms() == 0.0 and session.holds.hold_s() == 0.0
    session.holds.recent_step_ms.extend([150.0, 90.0, 40.0, 25.0, 4.1, 3.9, 4.3, 4.0, 4.2, 3.8, 4.4])
    assert 3.8 <= session.holds.steady_step_ms() <= 4.4
    assert session.holds.hold_s() == 0.0  # a fast group is never held
    session.holds.recent_step_ms.extend([10.0] * holds_module.STEADY_STEPS)  # holds for permits, not for the commit
    assert session.holds.hold_s() == holds_module.PRECOPY_HOLD_STEP_FRACTION * 10.0 / 1000.0
    assert session.holds.hold_s(holds_module.COMMIT_HOLD_MIN_STEP_MS) == 0.0
    session.holds.recent_step_ms.extend([20.0] * holds_module.STEADY_STEPS)
    assert session.holds.hold_s(holds_module.COMMIT_HOLD_MIN_STEP_MS) == session.holds.hold_s()
    assert session.holds.steady_step_ms() == 20.0
    assert session.holds.hold_s() == holds_module.PRECOPY_HOLD_STEP_FRACTION * 20.0 / 1000.0
    session.holds.recent_step_ms.extend([400.0] * holds_module.STEADY_STEPS)
    assert session.holds.hold_s() == holds_module.PRECOPY_HOLD_MAX_S
