"""The soak benchmark's pure parts: fault schedule, fault windows, request outcomes, series slopes."""

from __future__ import annotations

import pytest

from nitsum_load.bench_soak import parse_args
from nitsum_load.client import RequestSpec, RequestTracker
from nitsum_load.soak_core import (
    NATS_RESTART,
    WORKER_KILL,
    FaultRecord,
    FaultWindow,
    Outcome,
    PlannedFault,
    Sample,
    SeriesSummary,
    count_outcomes,
    fault_windows,
    outcome_of,
    overlaps,
    plan_faults,
    slope_per_min,
    summarize_series,
)
from nitsum_load.soak_probes import parse_gauge


def test_plan_kills_round_robin_and_restarts_nats_in_the_middle_gap():
    assert plan_faults(600.0, 120.0, 2) == [
        PlannedFault(120.0, WORKER_KILL, "worker-0"),
        PlannedFault(240.0, WORKER_KILL, "worker-1"),
        PlannedFault(300.0, NATS_RESTART, "nats-server"),
        PlannedFault(360.0, WORKER_KILL, "worker-0"),
        PlannedFault(480.0, WORKER_KILL, "worker-1"),
    ]


def test_plan_quick_one_kill_and_the_restart_in_the_larger_gap():
    assert plan_faults(60.0, 20.0, 2, max_kills=1) == [
        PlannedFault(20.0, WORKER_KILL, "worker-0"),
        PlannedFault(40.0, NATS_RESTART, "nats-server"),
    ]
    # No kill fits before the tail: only the restart, in the middle of the run.
    assert plan_faults(30.0, 25.0, 1, tail_s=10.0) == [PlannedFault(15.0, NATS_RESTART, "nats-server")]
    assert plan_faults(60.0, 20.0, 3, nats_restart=False) == [
        PlannedFault(20.0, WORKER_KILL, "worker-0"),
        PlannedFault(40.0, WORKER_KILL, "worker-1"),
    ]


def test_windows_run_from_the_fault_to_grace_after_recovery_or_to_the_end():
    faults = [FaultRecord(WORKER_KILL, "worker-0", 10.0, 14.0), FaultRecord(NATS_RESTART, "nats-server", 50.0, None)]
    assert fault_windows(faults, 15.0, 80.0) == [
        FaultWindow(10.0, 29.0, WORKER_KILL),
        FaultWindow(50.0, 80.0, NATS_RESTART),
    ]


def test_overlap_includes_touching_edges():
    windows = [FaultWindow(10.0, 20.0, WORKER_KILL)]
    assert overlaps(5.0, 10.0, windows)
    assert overlaps(20.0, 25.0, windows)
    assert overlaps(12.0, 13.0, windows)
    assert not overlaps(0.0, 9.99, windows)
    assert not overlaps(20.01, 30.0, windows)
    assert not overlaps(0.0, 100.0, [])


def _tracker(i: int, *, done: bool = False, error: str | None = None) -> RequestTracker:
    spec = RequestSpec(
        f"req-{i}",
        arrival_ms=1000.0 * i,
        prompt_tokens=4,
        output_tokens=2,
        tier="interactive",
        ttft_slo_ms=100.0,
        tpot_slo_ms=10.0,
        weight=1.0,
    )
    t = RequestTracker(spec)
    if done:
        t.token_times_ms.extend([1000.0 * i + 5, 1000.0 * i + 6])
        t.done_ms = 1000.0 * i + 7
    if error is not None:
        t.fail(error, "why")
    return t


def test_outcomes_ok_failed_and_lost():
    assert outcome_of(_tracker(1, done=True), 1007.0) == Outcome("req-1", 1.0, 1.007, "ok", None)
    assert outcome_of(_tracker(2, error="http_503"), 2500.0) == Outcome("req-2", 2.0, 2.5, "failed", "http_503")
    # Cancelled while still running at the end, and a client timeout: both never ended by the server.
    assert outcome_of(_tracker(3), None) == Outcome("req-3", 3.0, None, "lost", None)
    assert outcome_of(_tracker(4, error="timeout"), 64000.0).status == "lost"


def test_counts_split_failures_by_fault_window():
    outcomes = [
        Outcome("a", 1.0, 1.1, "ok", None),
        Outcome("b", 9.0, 10.5, "failed", "http_503"),  # ends inside the window
        Outcome("c", 12.0, 12.1, "failed", "stream_error"),
        Outcome("d", 30.0, 30.2, "failed", "http_503"),  # outside
        Outcome("e", 40.0, None, "lost", None),
    ]
    counts = count_outcomes(outcomes, [FaultWindow(10.0, 20.0, WORKER_KILL)], run_end_s=50.0)
    assert (counts.sent, counts.completed, counts.failed_in_windows, counts.failed_outside_windows, counts.lost) == (
        5,
        1,
        2,
        1,
        1,
    )
    assert counts.errors_in_windows == {"http_503": 1, "stream_error": 1}
    assert counts.errors_outside_windows == {"http_503": 1}


def test_slope_per_minute():
    assert slope_per_min([(0.0, 1.0), (60.0, 2.0), (120.0, 3.0)]) == pytest.approx(1.0)
    assert slope_per_min([(0.0, 5.0), (30.0, 5.0), (90.0, 5.0)]) == 0.0
    assert slope_per_min([(0.0, 1.0), (60.0, 2.0)]) is None
    assert slope_per_min([(5.0, 1.0), (5.0, 2.0), (5.0, 3.0)]) is None


def test_series_after_warmup_and_a_restarted_worker_gets_its_own_warmup():
    samples = [Sample(float(t), "gateway", 10, 50.0 + t, 9.0) for t in range(0, 50, 10)]
    samples += [Sample(float(t), "worker-0", 20, 300.0, 13.0) for t in (0, 10)]
    # Restarted at 20 s: its RSS climbs while it loads, then stays flat.
    samples += [
        Sample(float(t), "worker-0", 21, rss, 13.0)
        for t, rss in ((20, 100.0), (30, 300.0), (40, 300.0), (50, 300.0), (60, 300.0))
    ]
    samples += [Sample(float(t), "nats-server", 30, 15.0, None) for t in range(0, 50, 10)]
    got = {(s.process, s.metric): s for s in summarize_series(samples, warmup_s=10.0)}
    assert ("nats-server", "asyncio_tasks") not in got
    assert got[("gateway", "rss_mib")] == SeriesSummary("gateway", "rss_mib", 4, 60.0, 90.0, 90.0, 60.0)
    assert got[("worker-0", "rss_mib")] == SeriesSummary("worker-0", "rss_mib", 4, 300.0, 300.0, 300.0, 0.0)


def test_parse_gauge_and_quick_defaults():
    text = "# HELP nitsum_asyncio_tasks x\n# TYPE nitsum_asyncio_tasks gauge\nnitsum_asyncio_tasks 17.0\n"
    assert parse_gauge(text, "nitsum_asyncio_tasks") == 17.0
    assert parse_gauge(text, "nitsum_other") is None
    args = parse_args(["--quick", "--out", "x"])
    assert (args.minutes, args.kill_every, args.max_kills, args.warmup_s) == (1.0, 0.5, 1, 10.0)
    args = parse_args(["--minutes", "5", "--out", "x"])
    assert (args.minutes, args.kill_every, args.max_kills, args.sample_s) == (5.0, 2.0, None, 5.0)
    with pytest.raises(SystemExit):
        parse_args(["--rate", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--load-fraction", "1.5"])
