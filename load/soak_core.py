"""The soak benchmark's functional core (pure, no clock reads, no I/O): the fault schedule, fault windows,
request outcomes and their counts, and the slopes of the sampled series. `nitsum bench soak` is bench_soak."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nitsum_load.client import RequestTracker

WORKER_KILL = "worker_kill"
NATS_RESTART = "nats_restart"


@dataclass(frozen=True)
class PlannedFault:
    at_s: float
    kind: str  # WORKER_KILL | NATS_RESTART
    target: str  # child name in processes.json, or "nats-server"


def plan_faults(
    duration_s: float,
    kill_every_s: float,
    num_workers: int,
    *,
    max_kills: int | None = None,
    nats_restart: bool = True,
    tail_s: float = 10.0,
) -> list[PlannedFault]:
    """Kills at every multiple of kill_every_s that leaves `tail_s` before the end (round-robin over the workers),
    and one NATS restart in the middle of the largest gap between events (the gap whose midpoint is nearest the
    run's midpoint on ties), so it is as far as the schedule allows from any kill."""
    assert duration_s > 0 and kill_every_s > 0 and num_workers >= 1, "positive duration, period and workers"
    kills = []
    k = 1
    while k * kill_every_s <= duration_s - tail_s and (max_kills is None or len(kills) < max_kills):
        kills.append(PlannedFault(k * kill_every_s, WORKER_KILL, f"worker-{(k - 1) % num_workers}"))
        k += 1
    out = list(kills)
    if nats_restart:
        points = [0.0, *(f.at_s for f in kills), duration_s]
        gaps = list(zip(points, points[1:]))
        best = max(gaps, key=lambda g: (round(g[1] - g[0], 9), -abs((g[0] + g[1]) / 2 - duration_s / 2)))
        out.append(PlannedFault((best[0] + best[1]) / 2, NATS_RESTART, "nats-server"))
    return sorted(out, key=lambda f: f.at_s)


@dataclass(frozen=True)
class FaultRecord:
    """A fault as it happened: when it was injected and when the mesh was whole again (None: not within the
    recovery timeout). Times are seconds on the soak clock (0 = first request's scheduled arrival)."""

    kind: str
    target: str
    at_s: float
    recovered_s: float | None
    detail: str = ""


@dataclass(frozen=True)
class FaultWindow:
    start_s: float
    end_s: float
    kind: str


def fault_windows(faults: Sequence[FaultRecord], grace_s: float, run_end_s: float) -> list[FaultWindow]:
    """From each fault to grace_s after its recovery; an unrecovered fault's window lasts to the end of the run."""
    return [
        FaultWindow(f.at_s, run_end_s if f.recovered_s is None else f.recovered_s + grace_s, f.kind) for f in faults
    ]


def overlaps(start_s: float, end_s: float, windows: Sequence[FaultWindow]) -> bool:
    return any(start_s <= w.end_s and end_s >= w.start_s for w in windows)


@dataclass(frozen=True)
class Outcome:
    """What happened to one request, on the soak clock (seconds)."""

    request_id: str
    send_s: float
    end_s: float | None  # when the client saw its end (done, error or timeout); None = never ended
    status: str  # "ok" | "failed" | "lost"
    error: str | None


def outcome_of(tracker: RequestTracker, ended_ms: float | None) -> Outcome:
    """ok: finished; lost: never ended by the server (still running when the run gave up, or a client timeout);
    failed: ended with an error the server (or the connection) gave."""
    if tracker.finished:
        status = "ok"
    elif tracker.error is None or tracker.error == "timeout":
        status = "lost"
    else:
        status = "failed"
    return Outcome(
        tracker.spec.request_id,
        tracker.spec.arrival_ms / 1000.0,
        None if ended_ms is None else ended_ms / 1000.0,
        status,
        tracker.error,
    )


@dataclass(frozen=True)
class SoakCounts:
    sent: int
    completed: int
    failed_in_windows: int
    failed_outside_windows: int
    lost: int
    errors_in_windows: dict[str, int]
    errors_outside_windows: dict[str, int]


def count_outcomes(outcomes: Sequence[Outcome], windows: Sequence[FaultWindow], run_end_s: float) -> SoakCounts:
    failed_in, failed_out = 0, 0
    errs_in: dict[str, int] = {}
    errs_out: dict[str, int] = {}
    for o in outcomes:
        if o.status != "failed":
            continue
        inside = overlaps(o.send_s, run_end_s if o.end_s is None else o.end_s, windows)
        failed_in += inside
        failed_out += not inside
        bucket = errs_in if inside else errs_out
        bucket[str(o.error)] = bucket.get(str(o.error), 0) + 1
    return SoakCounts(
        sent=len(outcomes),
        completed=sum(o.status == "ok" for o in outcomes),
        failed_in_windows=failed_in,
        failed_outside_windows=failed_out,
        lost=sum(o.status == "lost" for o in outcomes),
        errors_in_windows=errs_in,
        errors_outside_windows=errs_out,
    )


@dataclass(frozen=True)
class Sample:
    t_s: float
    process: str  # child name from processes.json, or "nats-server"
    pid: int
    rss_mib: float | None
    asyncio_tasks: float | None


def slope_per_min(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t_s, value) in value per minute; None with fewer than 3 points or one time."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / var


@dataclass(frozen=True)
class SeriesSummary:
    """One process's metric after warm-up, over the samples of the pid it ended with. A restarted worker starts
    a fresh series and gets a warm-up of its own (from its first sample), so its start-up is not read as growth."""

    process: str
    metric: str  # "rss_mib" | "asyncio_tasks"
    samples: int
    first: float | None
    last: float | None
    max: float | None
    slope_per_min: float | None


def summarize_series(samples: Sequence[Sample], warmup_s: float) -> list[SeriesSummary]:
    out = []
    for process in sorted({s.process for s in samples}):
        mine = [s for s in samples if s.process == process]
        last_pid = mine[-1].pid
        born_s = min(s.t_s for s in mine if s.pid == last_pid)
        kept = [s for s in mine if s.pid == last_pid and s.t_s >= max(warmup_s, born_s + warmup_s)]
        for metric in ("rss_mib", "asyncio_tasks"):
            pts = [(s.t_s, getattr(s, metric)) for s in kept if getattr(s, metric) is not None]
            if not pts and all(getattr(s, metric) is None for s in mine):
                continue  # this process does not expose the metric at all (nats-server has no asyncio)
            values = [v for _, v in pts]
            out.append(
                SeriesSummary(
                    process,
                    metric,
                    len(pts),
                    values[0] if values else None,
                    values[-1] if values else None,
                    max(values) if values else None,
                    slope_per_min(pts),
                )
            )
    return out
