"""`nitsum bench soak`: steady load on the live mesh for N minutes while workers are killed and NATS restarts.

    nitsum bench soak --minutes 10 --kill-every 2 --out /tmp/soak        # about 70% of measured capacity
    nitsum bench soak --quick --out /tmp/soak-quick                      # 1 minute, one kill, one NATS restart

Steps: start a nats-server of our own (so it can be restarted) and `nitsum up --devices N --nats URL`; measure
capacity with a short ramp of Poisson steps (`--rate` skips it); then send open-loop Poisson load at
`--load-fraction` of it while, on a fixed schedule, a worker is SIGKILLed (pid from the run's processes.json;
`nitsum up` restarts it) every `--kill-every` minutes and NATS is stopped and restarted once. A fault window runs
from the fault to `--grace-s` after recovery (the mesh has every worker ready again and /ready answers 200); a
request counts as inside one when its lifetime overlaps it. Reported: requests sent, completed, failed inside and
outside fault windows (goal outside: 0), lost = sent but never ended by the server (cancelled at the end, or a
client timeout; goal 0), and per process the RSS (/proc/<pid>/status VmRSS) and the asyncio task count
(`nitsum_asyncio_tasks` from each service's /metrics) over time, with the slope after warm-up (goal: flat).

Files in --out: soak.md (summary), soak.json, soak_series.csv (t_s, process, pid, rss_mib, asyncio_tasks),
soak_requests.csv, soak.png, and load/ (the `nitsum load` report of the soak phase).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nitsum.metrics import summarize
from nitsum.natsserver import NatsServer, free_port
from nitsum_load.client import ClientConfig, RequestSpec, RequestTracker, send
from nitsum_load.mesh import LocalMesh, start_mesh
from nitsum_load.report import format_table, write_all
from nitsum_load.runner import run_open_loop
from nitsum_load.workload import Shaping, shape, synthetic

WORKER_KILL = "worker_kill"
NATS_RESTART = "nats_restart"
# How long to wait for a fault to heal before the window is closed at the end of the run (recovery "never").
RECOVERY_TIMEOUT_S = 90.0
ADMIN_STATUS_SUBJECT = "nitsum.admin.status"


# ---------------------------------------------------------------- functional core: schedule, windows, counts


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


# ---------------------------------------------------------------- shell: processes, probes, load


def read_pids(run_dir: Path) -> dict[str, int]:
    """processes.json of `nitsum up` (child name -> pid); {} while it is being rewritten or absent."""
    try:
        return {str(k): int(v) for k, v in json.loads((run_dir / "processes.json").read_text()).items()}
    except (OSError, ValueError):
        return {}


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def metrics_port(pid: int) -> int | None:
    """The NITSUM_METRICS_PORT `nitsum up` gave this child (from its environment; same user, so readable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"NITSUM_METRICS_PORT="):
            port = int(item.split(b"=", 1)[1] or 0)
            return port if port > 0 else None
    return None


def parse_gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def sample_once(t_s: float, run_dir: Path, gateway_url: str, nats: NatsServer) -> list[Sample]:
    """RSS of every child and of nats-server; asyncio tasks of every service that serves /metrics."""
    out = []
    for name, pid in sorted(read_pids(run_dir).items()):
        if name == "gateway":
            url = gateway_url + "/metrics"  # the gateway serves /metrics on its API port
        else:
            port = metrics_port(pid)
            url = None if port is None else f"http://127.0.0.1:{port}/metrics"
        tasks = None
        if url is not None:
            status, text = http_get(url)
            tasks = parse_gauge(text, "nitsum_asyncio_tasks") if status == 200 else None
        out.append(Sample(t_s, name, pid, rss_mib(pid), tasks))
    if nats.process is not None and nats.process.poll() is None:
        out.append(Sample(t_s, "nats-server", nats.process.pid, rss_mib(nats.process.pid), None))
    return out


async def admin_status(nats_url: str) -> dict | None:
    """The coordinator's admin status over our (unauthenticated) NATS; None when it does not answer."""
    import nats as nats_py

    try:
        nc = await nats_py.connect(
            servers=[nats_url], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=1
        )
    except Exception:  # nats-py raises several unrelated types when the server is down  # noqa: BLE001
        return None
    try:
        msg = await nc.request(ADMIN_STATUS_SUBJECT, b"{}", timeout=1.0)
        return json.loads(msg.data)
    except Exception:  # no responders / timeout while the coordinator reconnects  # noqa: BLE001
        return None
    finally:
        await nc.close()


def ready_workers(status: dict | None) -> set[str]:
    return {w["worker_id"] for w in (status or {}).get("workers", []) if w.get("state") == "ready"}


async def wait_whole(
    nats_url: str, gateway_url: str, num_workers: int, deadline: float, gone_worker: str | None = None
) -> bool:
    """Until the mesh is whole: every worker ready and /ready 200. After a kill, first wait (a few heartbeat
    timeouts at most) for the coordinator to see the victim not ready, so a stale 'ready' entry is not taken
    for recovery."""
    loop = asyncio.get_running_loop()
    if gone_worker is not None:
        seen_gone_by = min(deadline, loop.time() + 10.0)
        while loop.time() < seen_gone_by:
            if gone_worker not in ready_workers(await admin_status(nats_url)):
                break
            await asyncio.sleep(0.2)
    while loop.time() < deadline:
        if len(ready_workers(await admin_status(nats_url))) >= num_workers:
            status, _ = await asyncio.to_thread(http_get, gateway_url + "/ready")
            if status == 200:
                return True
        await asyncio.sleep(0.25)
    return False


async def fire_timed(
    specs: Sequence[RequestSpec],
    cfg: ClientConfig,
    t0: float,
    drain_timeout_s: float,
) -> list[tuple[RequestTracker, float | None]]:
    """Open-loop dispatch like `run_open_loop`, but every request's end time is kept: a RequestTracker has no
    time for an error, and the soak must place each failure inside or outside the fault windows."""
    import aiohttp

    loop = asyncio.get_running_loop()

    def clock() -> float:
        return (loop.time() - t0) * 1000.0

    rows: list[list[Any]] = []

    async def one(row: list[Any], index: int) -> None:
        await send(session, cfg, row[0], clock, seed_index=index)
        row[1] = clock()

    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            for index, spec in enumerate(sorted(specs, key=lambda s: s.arrival_ms)):
                delay_s = spec.arrival_ms / 1000.0 - (loop.time() - t0)
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                row = [RequestTracker(spec), None]
                rows.append(row)
                tasks.append(asyncio.create_task(one(row, index), name=spec.request_id))
            pending = [t for t in tasks if not t.done()]
            if pending:
                await asyncio.wait(pending, timeout=drain_timeout_s)
        finally:
            for t in tasks:
                t.cancel()  # what is still running now is lost; its tracker keeps what was seen
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    raise r
    return [(row[0], row[1]) for row in rows]


def poisson_specs(
    rate_per_s: float, duration_s: float, prompt_tokens: int, output_tokens: int, seed: int
) -> list[RequestSpec]:
    reqs = synthetic(
        "poisson",
        rate_per_s,
        num_requests=None,
        duration_s=duration_s,
        seed=seed,
        lengths=None,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
    )
    return shape(reqs, Shaping(seed=seed))


@dataclass(frozen=True)
class RampStep:
    rate_per_s: float
    sent: int
    completed: int
    failed: int
    ttft_p90_ms: float | None
    sustained: bool


async def measure_capacity(cfg: ClientConfig, args: argparse.Namespace) -> tuple[float, list[RampStep]]:
    """Poisson steps at rising rates (x1.5) until one is not sustained: an error, a request not done within
    2 s of the step's end, or TTFT p90 above --ramp-ttft-ms (a queue is building). Capacity = the last
    sustained rate."""
    steps: list[RampStep] = []
    rate = args.ramp_start_rate
    for i in range(args.ramp_max_steps):
        specs = poisson_specs(rate, args.ramp_step_s, args.prompt_tokens, args.output_tokens, seed=args.seed + 1 + i)
        result = await run_open_loop(specs, cfg, duration_s=args.ramp_step_s, drain_timeout_s=2.0)
        report = summarize([t.to_record() for t in result.trackers]).overall
        p90 = report.ttft_ms.p90
        ok = (
            report.failed == 0
            and report.succeeded == len(result.trackers)
            and p90 is not None
            and p90 <= args.ramp_ttft_ms
        )
        steps.append(RampStep(rate, len(result.trackers), report.succeeded, report.failed, p90, ok))
        print(
            f"  ramp {rate:7.2f} req/s: {report.succeeded}/{len(result.trackers)} done, "
            f"TTFT p90 {'-' if p90 is None else f'{p90:.0f}'} ms -> {'sustained' if ok else 'not sustained'}",
            flush=True,
        )
        if not ok:
            break
        rate *= 1.5
        await asyncio.sleep(2.0)  # let any tail finish before the next step
    sustained = [s.rate_per_s for s in steps if s.sustained]
    if steps[-1].sustained:
        print(
            f"  the ramp ran out of steps before overload: capacity is at least {steps[-1].rate_per_s:.2f} req/s "
            "(raise --ramp-max-steps to find it)",
            flush=True,
        )
    return (max(sustained) if sustained else steps[0].rate_per_s / 1.5), steps


@dataclass
class FaultInjector:
    nats: NatsServer
    nats_url: str
    run_dir: Path
    gateway_url: str
    num_workers: int
    nats_down_s: float
    t0: float
    log_dir: Path
    records: list[FaultRecord] = field(default_factory=list)

    async def run(self, plan: Sequence[PlannedFault]) -> None:
        loop = asyncio.get_running_loop()
        for fault in plan:
            delay_s = fault.at_s - (loop.time() - self.t0)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            at_s = loop.time() - self.t0
            detail = ""
            gone = None
            if fault.kind == WORKER_KILL:
                pid = read_pids(self.run_dir).get(fault.target)
                if pid is None:
                    self.records.append(FaultRecord(fault.kind, fault.target, at_s, None, "no such child"))
                    continue
                os.kill(pid, 9)  # SIGKILL: no drain, no goodbye; `nitsum up` restarts it
                detail = f"pid {pid}"
                gone = "node0-" + fault.target.split("-", 1)[1]  # nitsum up names worker-i's id node0-i
            else:
                await asyncio.to_thread(self.nats.stop)
                await asyncio.sleep(self.nats_down_s)
                await asyncio.to_thread(self.nats.start, self.log_dir / "nats-server.log")
                detail = f"down {self.nats_down_s:g} s"
            whole = await wait_whole(
                self.nats_url, self.gateway_url, self.num_workers, loop.time() + RECOVERY_TIMEOUT_S, gone_worker=gone
            )
            rec_s = loop.time() - self.t0 if whole else None
            self.records.append(FaultRecord(fault.kind, fault.target, at_s, rec_s, detail))
            print(
                f"  fault {fault.kind} {fault.target} at {at_s:.1f} s ({detail}); "
                f"{'whole again at ' + format(rec_s, '.1f') + ' s' if whole else 'NOT recovered'}",
                flush=True,
            )


async def sampler(
    stop: asyncio.Event,
    period_s: float,
    t0: float,
    run_dir: Path,
    gateway_url: str,
    nats: NatsServer,
    out: list[Sample],
) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        out.extend(await asyncio.to_thread(sample_once, loop.time() - t0, run_dir, gateway_url, nats))
        try:
            await asyncio.wait_for(stop.wait(), timeout=period_s)
        except TimeoutError:
            pass


# ---------------------------------------------------------------- outputs


def write_series_csv(samples: Sequence[Sample], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(("t_s", "process", "pid", "rss_mib", "asyncio_tasks"))
        for s in samples:
            w.writerow(
                (
                    f"{s.t_s:.2f}",
                    s.process,
                    s.pid,
                    "" if s.rss_mib is None else f"{s.rss_mib:.1f}",
                    "" if s.asyncio_tasks is None else f"{s.asyncio_tasks:g}",
                )
            )


def write_requests_csv(
    outcomes: Sequence[Outcome], windows: Sequence[FaultWindow], run_end_s: float, path: Path
) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(("request_id", "send_s", "end_s", "status", "error", "in_fault_window"))
        for o in outcomes:
            inside = overlaps(o.send_s, run_end_s if o.end_s is None else o.end_s, windows)
            w.writerow(
                (
                    o.request_id,
                    f"{o.send_s:.3f}",
                    "" if o.end_s is None else f"{o.end_s:.3f}",
                    o.status,
                    o.error or "",
                    int(inside),
                )
            )


def write_plot(
    samples: Sequence[Sample],
    outcomes: Sequence[Outcome],
    faults: Sequence[FaultRecord],
    windows: Sequence[FaultWindow],
    run_end_s: float,
    warmup_s: float,
    path: Path,
) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 9), layout="constrained")
    ax_rss, ax_tasks, ax_req = fig.subplots(3, 1, sharex=True)
    for i, process in enumerate(sorted({s.process for s in samples})):
        mine = [s for s in samples if s.process == process]
        # A restarted worker's new pid starts a new line (same colour): the series are per process instance.
        for k, pid in enumerate(dict.fromkeys(s.pid for s in mine)):
            seg = [s for s in mine if s.pid == pid]
            for ax, metric in ((ax_rss, "rss_mib"), (ax_tasks, "asyncio_tasks")):
                pts = [(s.t_s, getattr(s, metric)) for s in seg if getattr(s, metric) is not None]
                if pts:
                    ax.plot(
                        [t for t, _ in pts],
                        [v for _, v in pts],
                        linewidth=1,
                        color=f"C{i % 10}",
                        label=process if k == 0 else None,
                    )
    bin_s = float(max(1, round(run_end_s / 60.0)))
    nbins = max(1, int(run_end_s / bin_s) + 1)
    edges = [i * bin_s for i in range(nbins + 1)]
    for status, color in (("ok", "tab:green"), ("failed", "tab:red"), ("lost", "black")):
        counts = [0] * nbins
        for o in outcomes:
            if o.status == status:
                counts[min(nbins - 1, int(o.send_s / bin_s))] += 1
        if any(counts):
            ax_req.stairs([c / bin_s for c in counts], edges, label=status, color=color)
    for ax in (ax_rss, ax_tasks, ax_req):
        for w in windows:
            ax.axvspan(w.start_s, w.end_s, color="tab:orange" if w.kind == NATS_RESTART else "tab:red", alpha=0.12)
        ax.axvline(warmup_s, color="gray", linestyle=":", linewidth=0.8)
        ax.grid(alpha=0.3)
    for f in faults:
        ax_rss.annotate(
            "NATS" if f.kind == NATS_RESTART else f"kill {f.target}",
            (f.at_s, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            rotation=90,
            va="top",
        )
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.set_title("Soak: shaded = fault windows (red worker kill, orange NATS restart); dotted = end of warm-up")
    ax_tasks.set_ylabel("asyncio tasks")
    ax_req.set_ylabel(f"requests/s by send time ({bin_s:g} s bins)")
    ax_req.set_xlabel("seconds since the soak started")
    for ax in (ax_rss, ax_tasks, ax_req):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=7, ncol=4)
    fig.savefig(path, dpi=100)


def format_markdown(result: dict[str, Any]) -> str:
    c = result["counts"]
    lines = [
        "# nitsum bench soak",
        "",
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}; machine: {result['machine']['platform']}, {result['machine']['cpus']} CPUs; "
        f"{result['devices']} workers.",
        "",
        f"Capacity: {_capacity(result)} -> offered {result['rate_rps']:.2f} req/s "
        f"Poisson for {result['duration_s']:.0f} s; prompt {result['prompt_tokens']} / output "
        f"{result['output_tokens']} tokens.",
        "",
        "| requests | count | goal |",
        "|---|---:|---|",
        f"| sent | {c['sent']} | |",
        f"| completed | {c['completed']} | |",
        f"| failed inside fault windows | {c['failed_in_windows']} | |",
        f"| failed outside fault windows | {c['failed_outside_windows']} | 0 |",
        f"| lost (sent, never ended) | {c['lost']} | 0 |",
        "",
        f"Errors inside windows: {_errs(c['errors_in_windows'])}; outside: {_errs(c['errors_outside_windows'])}.",
        f"Latency (all requests): TTFT p50/p90 {_num(result['ttft_ms']['p50'])}/{_num(result['ttft_ms']['p90'])} ms,"
        f" TPOT p50/p90 {_num(result['tpot_ms']['p50'])}/{_num(result['tpot_ms']['p90'])} ms.",
        "",
        "| fault | target | at s | whole again s | window s |",
        "|---|---|---:|---:|---|",
    ]
    for f, w in zip(result["faults"], result["windows"]):
        rec = "never" if f["recovered_s"] is None else f"{f['recovered_s']:.1f}"
        lines.append(
            f"| {f['kind']} | {f['target']} ({f['detail']}) | {f['at_s']:.1f} | {rec} | "
            f"{w['start_s']:.1f}-{w['end_s']:.1f} |"
        )
    lines += [
        "",
        f"After warm-up ({result['warmup_s']:.0f} s), per process (the pid it ended with):",
        "",
        "| process | metric | samples | first | last | max | slope /min |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in result["series"]:
        lines.append(
            f"| {s['process']} | {s['metric']} | {s['samples']} | {_num(s['first'])} | {_num(s['last'])} "
            f"| {_num(s['max'])} | {_num(s['slope_per_min'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def _capacity(result: dict[str, Any]) -> str:
    if result["capacity_rps"] is None:
        return "not measured (--rate given)"
    ramp = result["ramp"]
    bound = ">= " if ramp and ramp[-1]["sustained"] else ""  # the ramp never reached overload
    return f"{bound}{result['capacity_rps']:.2f} req/s (Poisson ramp, {len(ramp)} steps)"


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _errs(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(errors.items())) or "none"


# ---------------------------------------------------------------- the run


async def soak(args: argparse.Namespace, gateway_url: str, nats: NatsServer, run_dir: Path) -> dict[str, Any]:
    from nitsum_load.cli import discover_model

    model = await discover_model(gateway_url, None)
    # Token-id prompts on /v1/completions and ignore_eos: every request has exactly the lengths asked for.
    cfg = ClientConfig(
        base_url=gateway_url,
        model=model,
        endpoint="completions",
        prompt_format="token-ids",
        return_token_ids=True,
        ignore_eos=True,
        request_timeout_s=args.request_timeout,
    )
    steps: list[RampStep] = []
    capacity = None
    if args.rate is not None:
        rate = args.rate
    else:
        print("measuring capacity (Poisson ramp) ...", flush=True)
        capacity, steps = await measure_capacity(cfg, args)
        rate = capacity * args.load_fraction
    duration_s = args.minutes * 60.0
    plan = plan_faults(
        duration_s,
        args.kill_every * 60.0,
        args.devices,
        max_kills=args.max_kills,
        nats_restart=not args.no_nats_restart,
        tail_s=min(10.0, duration_s / 4),
    )
    specs = poisson_specs(rate, duration_s, args.prompt_tokens, args.output_tokens, seed=args.seed)
    print(
        f"soak: {len(specs)} requests at {rate:.2f} req/s for {duration_s:.0f} s; faults: "
        + ", ".join(f"{f.kind} {f.target} @{f.at_s:.0f}s" for f in plan),
        flush=True,
    )

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stop = asyncio.Event()
    samples: list[Sample] = []
    injector = FaultInjector(nats, nats.url, run_dir, gateway_url, args.devices, args.nats_down_s, t0, args.out)
    sampling = asyncio.create_task(sampler(stop, args.sample_s, t0, run_dir, gateway_url, nats, samples))
    faulting = asyncio.create_task(injector.run(plan))
    try:
        rows = await fire_timed(specs, cfg, t0, drain_timeout_s=args.request_timeout + 5.0)
        run_end_s = loop.time() - t0
        await asyncio.wait_for(faulting, timeout=RECOVERY_TIMEOUT_S + 30.0)  # a last recovery may still run
    finally:
        faulting.cancel()
        stop.set()
        await asyncio.gather(sampling, faulting, return_exceptions=True)

    outcomes = [outcome_of(tracker, ended_ms) for tracker, ended_ms in rows]
    windows = fault_windows(injector.records, args.grace_s, run_end_s)
    counts = count_outcomes(outcomes, windows, run_end_s)
    trackers = [t for t, _ in rows]
    records = [t.to_record() for t in trackers]
    report = summarize(records)
    series = summarize_series(samples, args.warmup_s)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "nitsum bench soak " + " ".join(args.argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "devices": args.devices,
        "capacity_rps": capacity,
        "rate_rps": rate,
        "duration_s": duration_s,
        "run_end_s": run_end_s,
        "warmup_s": args.warmup_s,
        "grace_s": args.grace_s,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "ramp": [asdict(s) for s in steps],
        "planned_faults": [asdict(f) for f in plan],
        "faults": [asdict(f) for f in injector.records],
        "windows": [asdict(w) for w in windows],
        "counts": asdict(counts),
        "series": [asdict(s) for s in series],
        "ttft_ms": report.overall.to_dict()["ttft_ms"],
        "tpot_ms": report.overall.to_dict()["tpot_ms"],
    }
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    write_series_csv(samples, out / "soak_series.csv")
    write_requests_csv(outcomes, windows, run_end_s, out / "soak_requests.csv")
    write_plot(samples, outcomes, injector.records, windows, run_end_s, args.warmup_s, out / "soak.png")
    (out / "soak.md").write_text(format_markdown(result), encoding="utf-8")
    write_all(
        report,
        records,
        out / "load",
        {"soak": {k: result[k] for k in ("command", "rate_rps", "duration_s")}},
        log_rows=(t.to_log() for t in trackers),
    )
    print(format_table(report))
    return result


QUICK = {
    "minutes": 1.0,
    "kill_every": 0.5,
    "max_kills": 1,
    "warmup_s": 10.0,
    "sample_s": 1.0,
    "ramp_step_s": 4.0,
    "ramp_max_steps": 5,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nitsum bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=None, help="soak length (default 10; --quick 1)")
    p.add_argument(
        "--kill-every",
        type=float,
        default=None,
        metavar="MIN",
        help="SIGKILL a worker every MIN minutes (default 2; --quick: once, half-way)",
    )
    p.add_argument("--max-kills", type=int, default=None, help="at most this many kills")
    p.add_argument("--no-nats-restart", action="store_true", help="skip the NATS restart")
    p.add_argument("--quick", action="store_true", help="1 minute, one kill, one NATS restart, short ramp")
    p.add_argument("--devices", type=int, default=2, help="workers of the mesh (default 2: one spare)")
    p.add_argument("--policy", default=None, help="mesh policy (default: nitsum up's)")
    p.add_argument("--rate", type=float, default=None, metavar="RPS", help="offered rate; skips the capacity ramp")
    p.add_argument("--load-fraction", type=float, default=0.7, help="offered rate / measured capacity")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--ramp-start-rate", type=float, default=2.0, metavar="RPS")
    p.add_argument("--ramp-step-s", type=float, default=None, help="seconds per ramp step (default 8; --quick 4)")
    p.add_argument("--ramp-max-steps", type=int, default=None, help="default 12; --quick 5")
    p.add_argument("--ramp-ttft-ms", type=float, default=1000.0, help="a ramp step with TTFT p90 above is overload")
    p.add_argument("--grace-s", type=float, default=15.0, help="a fault window ends this long after recovery")
    p.add_argument("--warmup-s", type=float, default=None, help="series slopes start here (default 60; --quick 10)")
    p.add_argument("--sample-s", type=float, default=None, help="RSS / task sampling period (default 5; --quick 1)")
    p.add_argument("--nats-down-s", type=float, default=1.0, help="how long NATS stays down")
    p.add_argument("--request-timeout", type=float, default=60.0, metavar="S")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="report directory (default runs/soak-<time>)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    defaults = (
        QUICK
        if args.quick
        else {
            "minutes": 10.0,
            "kill_every": 2.0,
            "max_kills": None,
            "warmup_s": 60.0,
            "sample_s": 5.0,
            "ramp_step_s": 8.0,
            "ramp_max_steps": 12,
        }
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.minutes > 0 or not args.kill_every > 0 or not args.sample_s > 0 or not args.ramp_step_s > 0:
        p.error("--minutes, --kill-every, --sample-s and --ramp-step-s must be > 0")
    if args.devices < 1 or args.ramp_max_steps < 1 or (args.max_kills is not None and args.max_kills < 0):
        p.error("need --devices >= 1, --ramp-max-steps >= 1 and --max-kills >= 0")
    if args.rate is not None and not args.rate > 0:
        p.error("--rate must be > 0")
    if not 0 < args.load_fraction <= 1 or args.prompt_tokens < 1 or args.output_tokens < 1:
        p.error("need 0 < --load-fraction <= 1 and positive token counts")
    args.out = args.out or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S")
    args.argv = list(argv)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    mesh_dir = Path(tempfile.mkdtemp(prefix="nitsum-bench-soak-"))
    # Our own nats-server (no auth): the soak must be able to stop and restart it under the running mesh.
    nats = NatsServer(port=free_port(), config_path=None).start(log_path=args.out / "nats-server.log")
    mesh: LocalMesh | None = None
    try:
        extra = ("--nats", nats.url, *(("--policy", args.policy) if args.policy else ()))
        print(f"starting nitsum up --devices {args.devices} --nats {nats.url} (logs in {mesh_dir}) ...", flush=True)
        mesh = start_mesh(mesh_dir, devices=args.devices, extra_args=extra)
        result = asyncio.run(soak(args, mesh.url, nats, mesh_dir / "run"))
    except RuntimeError as exc:
        sys.stderr.write(f"nitsum bench soak: {exc}\n")
        return 1
    finally:
        if mesh is not None:
            mesh.stop()
        nats.stop()
    c = result["counts"]
    print(
        f"sent {c['sent']}, completed {c['completed']}, failed inside fault windows {c['failed_in_windows']}, "
        f"outside {c['failed_outside_windows']} (goal 0), lost {c['lost']} (goal 0); report in {args.out}"
    )
    return 0
