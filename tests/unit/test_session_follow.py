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

    def request_limits(self):
        return {"r1": (12, 40, 25.0)}

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
    assert session.step_thread.limits_at_commit == {"r1": (12, 40, 25.0)}  # and what they run under


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


def test_streams_adopted_at_a_commit_keep_their_limits():
    """A stream the new group's leader adopts at a commit knows its prompt, max_tokens and TPOT in stream indices
    (a re-submitted request's engine counts from the tokens it had streamed): without max_tokens, a prefill
    group's adopted request "ended" at its first token instead of being handed to a decode group."""
    from opentelemetry import trace

    from nitsum.bus import Subjects

    session = _session(_Peer([]))
    session.bus = SimpleNamespace(subjects=Subjects("nitsum"))
    session.tracer = trace.get_tracer("test")
    session.backend.group = "(0, 2)"
    session.stream_offsets["r2"] = 5  # re-submitted after 5 streamed tokens: its engine prompt holds them
    session.step_thread.held_at_commit = {"r1": 0, "r2": 3}
    session.step_thread.limits_at_commit = {"r1": (12, 40, 25.0), "r2": (17, 30, 0.0)}
    asyncio.run(session._after_commit(was_leader=False))
    r1, r2 = session.running["r1"], session.running["r2"]
    assert (r1.prompt_len, r1.next_index, r1.max_tokens, r1.tpot_ms) == (12, 0, 40, 25.0)
    assert (r2.prompt_len, r2.next_index, r2.max_tokens) == (12, 8, 35)
    assert session.step_thread.limits_at_commit == {} and session.step_thread.held_at_commit == {}
