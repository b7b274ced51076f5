"""The soak benchmark's outputs: soak_series.csv, soak_requests.csv, soak.png and the soak.md summary."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nitsum.metrics import Report, RequestRecord
from nitsum_load.client import RequestTracker
from nitsum_load.report import write_all
from nitsum_load.soak_core import NATS_RESTART, FaultRecord, FaultWindow, Outcome, Sample, overlaps


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


def write_outputs(
    out: Path,
    result: dict[str, Any],
    samples: Sequence[Sample],
    outcomes: Sequence[Outcome],
    faults: Sequence[FaultRecord],
    windows: Sequence[FaultWindow],
    report: Report,
    records: Sequence[RequestRecord],
    trackers: Sequence[RequestTracker],
) -> None:
    """Every file of --out: soak.json, the two CSVs, soak.png, soak.md and load/ (the `nitsum load` report)."""
    out.mkdir(parents=True, exist_ok=True)
    run_end_s, warmup_s = result["run_end_s"], result["warmup_s"]
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    write_series_csv(samples, out / "soak_series.csv")
    write_requests_csv(outcomes, windows, run_end_s, out / "soak_requests.csv")
    write_plot(samples, outcomes, faults, windows, run_end_s, warmup_s, out / "soak.png")
    (out / "soak.md").write_text(format_markdown(result), encoding="utf-8")
    write_all(
        report,
        records,
        out / "load",
        {"soak": {k: result[k] for k in ("command", "rate_rps", "duration_s")}},
        log_rows=(t.to_log() for t in trackers),
    )
