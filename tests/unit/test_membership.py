"""The coordinator's tables: rebuilt from heartbeats, expiry, restarts under the same id."""

from __future__ import annotations

import math
from dataclasses import replace

from nitsum.wire.messages import WorkerStats
from nitsum_services.coordinator.membership import Membership


def _stats(worker="w0", running=(), state="ready", instance="a", device=0):
    return WorkerStats(
        worker,
        "node0",
        device,
        "cpu",
        "hybrid",
        state,
        worker,
        1,
        "tiny",
        2048,
        len(running),
        0,
        10,
        10,
        tuple(running),
        instance_id=instance,
    )


def test_rebuild_from_heartbeats_after_a_restart():
    m = Membership(heartbeat_timeout_s=1.0)
    assert m.on_stats(_stats("w0", running=("r1", "r2")), now_s=0.0) == []
    assert sorted(m.requests) == ["r1", "r2"]
    assert m.requests["r1"].worker_id == "w0"


def test_assignment_lives_until_a_later_heartbeat_omits_it():
    m = Membership(1.0)
    m.on_stats(_stats(), 0.0)
    m.assign("r1", "interactive", "w0", now_s=10.0)
    m.on_stats(_stats(running=()), 10.5)  # built before the request reached the worker: keep it
    assert "r1" in m.requests and m.workers["w0"].load() == 1
    m.on_stats(_stats(running=("r1",)), 10.8)
    assert m.outstanding_by_tier() == {"interactive": 1}
    m.on_stats(_stats(running=()), 12.0)  # finished
    assert m.requests == {} and m.workers["w0"].load() == 0


def test_expiry_returns_the_lost_requests():
    m = Membership(1.0)
    m.on_stats(_stats("w0", running=("r1",)), 0.0)
    m.on_stats(_stats("w1", device=1), 0.0)
    m.on_stats(_stats("w1", device=1), 1.5)
    assert m.expire(now_s=1.6) == [("w0", ("r1",))]
    assert list(m.workers) == ["w1"] and m.requests == {}


def test_silent_lists_what_expire_removes():
    m = Membership(1.0)
    m.on_stats(_stats("w0"), 0.0)
    m.on_stats(_stats("w1", device=1), 0.5)
    assert m.silent(now_s=1.0) == []  # exactly the timeout is not yet silent
    assert m.silent(now_s=1.2) == ["w0"]
    assert m.silent(now_s=1.6) == ["w0", "w1"]
    assert sorted(w for w, _ in m.expire(1.6)) == ["w0", "w1"]


def test_credit_moves_every_last_seen_later_but_never_past_now():
    m = Membership(1.0)
    m.on_stats(_stats("w0", running=("r1",)), 0.0)
    m.on_stats(_stats("w1", device=1), 2.9)  # heard right after a stall, before the watch noticed it
    # The coordinator did not run from 0.25 to 3.0: 2.5 s beyond its period is nobody's silence.
    m.credit(2.5, now_s=3.0)
    assert m.workers["w0"].silence_from_s == 2.5
    assert m.workers["w1"].silence_from_s == 3.0  # capped at now: its silence is judged from now on, no later
    # The heartbeats themselves are what they were: a credit is not a sign of life (re-formation reads these).
    assert (m.workers["w0"].last_seen_s, m.workers["w1"].last_seen_s) == (0.0, 2.9)
    assert m.expire(now_s=3.0) == [] and m.silent(3.4) == []
    # A worker that is really gone is still lost, one timeout after the credited time.
    m.on_stats(_stats("w1", device=1), 3.5)
    assert m.expire(now_s=3.6) == [("w0", ("r1",))]
    assert list(m.workers) == ["w1"] and m.requests == {}


def test_credit_of_everything_counts_silence_from_now():
    m = Membership(1.0)
    m.on_stats(_stats("w0"), 0.0)
    m.on_stats(_stats("w1", device=1), 4.0)
    m.credit(math.inf, now_s=5.0)  # NATS answers again after not answering
    assert {w: r.silence_from_s for w, r in m.workers.items()} == {"w0": 5.0, "w1": 5.0}
    assert {w: r.last_seen_s for w, r in m.workers.items()} == {"w0": 0.0, "w1": 4.0}
    assert m.expire(5.9) == []
    assert [w for w, _ in m.expire(6.1)] == ["w0", "w1"]


def test_credit_without_workers_or_time_changes_nothing():
    m = Membership(1.0)
    m.credit(10.0, now_s=1.0)
    m.on_stats(_stats("w0"), 1.0)
    m.credit(0.0, now_s=5.0)
    assert m.workers["w0"].silence_from_s == 1.0 and m.silent(5.0) == ["w0"]


def test_a_new_instance_under_the_same_id_is_a_loss():
    m = Membership(5.0)
    m.on_stats(_stats(running=("r1", "r2"), instance="a"), 0.0)
    lost = m.on_stats(_stats(running=(), instance="b"), 0.5)
    assert lost == [("w0", ("r1", "r2"))]
    assert m.workers["w0"].stats.instance_id == "b" and m.requests == {}


def test_routable_excludes_draining_and_stopped():
    m = Membership(1.0)
    m.on_stats(_stats("w0"), 0.0)
    m.on_stats(_stats("w1", state="draining", device=1), 0.0)
    assert [w.worker_id for w in m.routable()] == ["w0"]
    assert m.routable(exclude=("w0",)) == []
    m.on_stats(_stats("w0", state="stopped"), 0.1)
    assert "w0" not in m.workers


def test_arrival_window_measures_recent_arrivals_per_tier():
    from nitsum_services.coordinator.snapshot import ArrivalWindow

    w = ArrivalWindow(window_ms=1000.0)
    w.add(0.0, "background", 10000.0, 100.0, 1.0, 100, 50)
    for t in (500.0, 600.0):
        w.add(t, "interactive", 200.0, 25.0, 10.0, 20, 8)
    stats = {a.tier: a for a in w.stats(now_ms=900.0)}
    assert stats["interactive"].rate_per_s == 2.0 and stats["interactive"].output_tokens == 8.0
    assert stats["background"].rate_per_s == 1.0
    assert [a.tier for a in w.stats(now_ms=1200.0)] == ["interactive"]  # the old one left the window
    assert w.stats(now_ms=5000.0) == ()


def test_a_heartbeat_from_before_a_recorded_commit_keeps_the_committed_group():
    """The coordinator records a commit when the old leader acks it; a peer's heartbeat built just before it
    switched may arrive later and must not undo that (the next prepare would skip a promoted leader)."""
    from dataclasses import replace

    m = Membership(5.0)
    peer = replace(_stats("w1", device=1), tp=2, group_id="node0-g0-tp2", leader=False, epoch=1, in_world=True)
    m.on_stats(peer, 0.0)
    record = m.workers["w1"]
    record.stats = replace(record.stats, tp=1, group_id="node0-g1-tp1", leader=True, epoch=2)  # as TransitionAgent does
    m.on_stats(replace(peer, num_waiting=3), 0.1)  # stale: epoch 1
    s = m.workers["w1"].stats
    assert (s.tp, s.group_id, s.leader, s.epoch, s.num_waiting) == (1, "node0-g1-tp1", True, 2, 3)
    # The worker's own word wins once it has caught up, or once it is out of the world (it left after a
    # failure: its old epoch is all it will ever report).
    m.on_stats(replace(peer, tp=1, group_id="node0-g1-tp1", leader=True, epoch=2), 0.2)
    assert m.workers["w1"].stats.epoch == 2
    record.stats = replace(record.stats, tp=2, group_id="node0-g0-tp2", leader=False, epoch=3)
    alone = replace(peer, tp=1, group_id="node0-g1-tp1", leader=True, epoch=2, in_world=False)
    m.on_stats(alone, 0.3)
    assert m.workers["w1"].stats == alone


def test_only_first_submissions_of_background_work_are_shed_after_admission_in_the_policys_order():
    m = Membership(heartbeat_timeout_s=5.0)
    m.on_stats(_stats(), 0.0)
    m.assign("fresh-1", "background", "w0", 0.0)
    m.assign("retried", "background", "w0", 0.0, resumed=3, attempt=1)  # re-submitted after a fault
    m.assign("fresh-2", "background", "w0", 0.0)
    m.assign("asked", "background", "w0", 0.0)
    m.assign("latency", "interactive", "w0", 0.0)  # admitted: refused at admission if hopeless, never dropped after
    policy_order = ["fresh-2", "retried", "unknown", "latency", "asked", "fresh-1"]
    assert m.sheddable(policy_order, asked={"asked"}) == ["fresh-2", "fresh-1"]
    m.assign("retried", "background", "w0", 1.0)  # what a later first submission under the same id would be
    assert m.sheddable(["retried"], asked=set()) == ["retried"]


def test_streams_a_heartbeat_says_ended_stop_counting_at_once_unless_a_newer_attempt_is_tracked():
    m = Membership(heartbeat_timeout_s=5.0)
    m.on_stats(_stats(), 0.0)
    m.assign("done", "interactive", "w0", 10.0)
    m.assign("again", "interactive", "w0", 10.0, attempt=2)  # re-submitted since attempt 1 ended here
    m.on_stats(_stats("w1", instance="b", device=1), 10.0)
    m.assign("moved", "interactive", "w1", 10.0)  # tracked on another worker now
    m.assign("running", "interactive", "w0", 10.0)
    ended = replace(
        _stats(running=("running",)),
        finished_request_ids=("done", "again", "moved", "running", "never-seen"),
        finished_attempts=(0, 1, 0, 0, 0),
    )
    m.on_stats(ended, 10.1)  # well within the grace a heartbeat's silence alone needs
    assert sorted(m.requests) == ["again", "moved", "running"]
    assert "done" not in m.workers["w0"].assigned and m.outstanding_by_tier() == {"interactive": 3}
