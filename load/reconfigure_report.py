"""`nitsum bench reconfigure`'s live report: the rows per transition (report.json), the table and summary
printed, and timeline.png."""

from __future__ import annotations

from pathlib import Path

from nitsum_load.reconfigure_core import SHAPE_NAMES, STALL_MS, restart_ms, stalls, transition_gaps


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_live_table(report: dict) -> str:
    lines = [
        "| transition | decide ms | prepare ms | pause (commit) ms | total ms | admin round trip ms "
        "| stream pause ms (steps) | max gap / steady gap before, after ms | pause vs before only ms "
        "| restart+reload ms | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['transition']} | {_fmt(r['decide_ms'])} | {_fmt(r['prepare_ms'])} | {_fmt(r['pause_ms'])} | "
            f"{_fmt(r['total_ms'])} | {_fmt(r['admin_rtt_ms'])} | {_fmt(r['stream_pause_ms'])} "
            f"({_fmt(r['stream_pause_steps'])}) | {_fmt(r['max_gap_ms'])} / {_fmt(r['steady_gap_ms'])}, "
            f"{_fmt(r.get('steady_gap_after_ms'))} | {_fmt(r.get('stream_pause_before_ms'))} | "
            f"{_fmt(r['restart_ms'], '.0f')} | {_fmt(r['speedup'], '.0f')}x |"
        )
    return "\n".join(lines)


def build_live_report(run: dict, restart: dict, histogram: dict | None, meta: dict) -> dict:
    steady_ms, per_window = transition_gaps(run["token_times_ms"], run["windows"])
    rows = []
    for (kind, src, dst), answer, (s, e), gap in zip(run["chain"], run["answers"], run["windows"], per_window):
        t = answer["transition"]
        base = restart_ms(restart["stop_ms"], restart["boot_ms"], restart["_to_target"], dst)
        rtt = e - s
        rows.append(
            {
                "transition": f"{kind} {SHAPE_NAMES[src]} -> {SHAPE_NAMES[dst]}",
                "epoch": t["epoch"],
                "decide_ms": t.get("decide_ms"),
                "prepare_ms": t["prepare_ms"],
                "pause_ms": t["pause_ms"],
                "total_ms": t["total_ms"],
                "admin_rtt_ms": rtt,
                "max_gap_ms": gap.max_gap_ms,
                "steady_gap_ms": gap.steady_ms,
                "steady_gap_after_ms": gap.steady_after_ms,
                "stream_pause_ms": gap.pause_ms,
                "stream_pause_steps": gap.pause_steps,
                "stream_pause_before_ms": gap.pause_before_ms,
                "streams_across": gap.streams_across,
                "restart_ms": base,
                "speedup": base / rtt if base is not None and rtt > 0 else None,
                **{f"worker_{k}": v for k, v in run.get("precopy", {}).get(t["epoch"], {}).items()},
            }
        )
    return {
        **meta,
        "steady_gap_ms": steady_ms,
        "rows": rows,
        "restart": {k: v for k, v in restart.items() if not k.startswith("_")},
        "coordinator_histogram_ms": histogram,
        "streams": run["streams"],
        "streams_failed": sum(1 for x in run["streams"] if x["error"] is not None),
        "stalls": stalls(run["token_times_ms"], STALL_MS),
        # Raw timeline (client clock, ms): each change's admin call (sent, answered) and every stream's
        # token arrivals, for a closer look at where a gap falls.
        "clock_origin_unix": run["origin_unix"],
        "windows_ms": [list(w) for w in run["windows"]],
        "token_times_ms": run["token_times_ms"],
    }


def write_timeline_plot(report: dict, path: Path) -> None:
    """Every stream's inter-token gaps over the run (a point per token, at its arrival), each change's admin
    call shaded and labelled with its stream pause, the steady gaps of the stretches between changes dashed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    ax = fig.subplots()
    for i, times in enumerate(report["token_times_ms"]):
        pts = [(b / 1000.0, b - a) for a, b in zip(times, times[1:])]
        if pts:
            ax.plot(
                [t for t, _ in pts], [g for _, g in pts], ".", markersize=3, color=f"C{i % 10}", label=f"stream {i}"
            )
    windows = report["windows_ms"]
    for k, ((start, end), row) in enumerate(zip(windows, report["rows"])):
        ax.axvspan(start / 1000.0, end / 1000.0, color="tab:orange", alpha=0.25)
        pause = row.get("stream_pause_steps")
        ax.annotate(
            f"{row['transition']}\ntotal {row['total_ms']:.0f} ms, pause {_fmt(pause, '.1f')} steps",
            (start / 1000.0, 1.0 - 0.09 * (k % 2)),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            va="top",
        )
        until = windows[k + 1][0] if k + 1 < len(windows) else None
        steady = row.get("steady_gap_after_ms")
        if steady and until is not None:
            ax.hlines(steady, end / 1000.0, until / 1000.0, colors="gray", linestyles="dashed", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the streams started")
    ax.set_ylabel("gap to the previous token (ms, log)")
    ax.set_title(
        f"nitsum bench reconfigure ({report['model']}): inter-token gaps; shaded = a TP change's admin call; "
        "dashed = steady gap at the new TP"
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=110)


def print_live_summary(report: dict, out: Path) -> None:
    """The table and the summary lines `nitsum bench reconfigure` prints (report: build_live_report's)."""
    rs = report["restart"]
    print(
        f"nitsum bench reconfigure (live): {report['devices']} CPU workers, model {report['model']} ({report['weight_store_bytes'] / 1e6:.1f} MB "
        f"fp32), {report['requests']} greedy streams, {report['machine']}; steady token gap {_fmt(report['steady_gap_ms'])} ms"
    )
    print(format_live_table(report))
    targets = ", ".join(f"{k} +{v:.0f} ms" for k, v in rs["to_target_ms"].items())
    print(
        f"restart+reload = stop {rs['stop_ms']:.0f} ms + boot {rs['boot_ms']:.0f} ms (/ready at {rs['ready_ms']:.0f} ms; "
        f"store deleted, {rs['store_reloaded_bytes'] / 1e6:.1f} MB re-read) + set-topology on the idle restarted mesh ({targets})"
    )
    print(
        "worker side, per change: longest prepare step (stops a group) / stage-M flows / pre-copied MB / "
        "pre-copy end after the pending ack: "
        + "; ".join(
            f"{r['transition'].split()[0]} {_fmt(r.get('worker_prepare_step_ms'), '.0f')} ms / "
            f"{r.get('worker_flows', '-')} / {(r.get('worker_bytes') or 0) / 1e6:.1f} / {_fmt(r.get('worker_precopy_ms'), '.0f')} ms"
            for r in report["rows"]
        )
    )
    histogram = report["coordinator_histogram_ms"]
    if histogram:
        print(
            "coordinator histogram (sum ms / count): "
            + ", ".join(f"{k} {v.get('sum', 0):.1f}/{v.get('count', 0):.0f}" for k, v in sorted(histogram.items()))
        )
    print(
        f"streams failed: {report['streams_failed']}/{report['requests']}; token gaps >= {STALL_MS / 1000:.0f} s (stalled hand-offs): "
        f"{report['stalls']}"
    )
    worst = max((r["stream_pause_steps"] or 0.0) for r in report["rows"])
    least = min((r["speedup"] or 0.0) for r in report["rows"])
    print(
        f"goals: speedup >= 100x: {'met' if least >= 100 else 'NOT met'} (lowest {least:.0f}x); "
        f"stream pause <= 2 steps: {'met' if worst <= 2 else 'NOT met'} (worst {worst:.1f}); report in {out} "
        f"(timeline.png: every stream's inter-token gaps across the changes)"
    )
