"""`nitsum bench fidelity`'s figures: the simulator against the live mesh side by side (bare table, then the
calibrated service model over seeds), the live spread and path breakdown printed, and the files of --out."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from nitsum.metrics import Report, percentile, summarize
from nitsum.policy.costmodel import DeviceSpec
from nitsum_load.fidelity_diagnostics import (
    METRICS,
    PATH_PARTS,
    bootstrap_intervals,
    format_breakdown,
    metric_values,
    path_breakdown,
    per_request_rows,
)
from nitsum_load.fidelity_sim import Session, split_rows
from nitsum_load.report import write_all

GOAL_REL_ERROR = 0.15


def side_by_side(live_report: Report, sim_report: Report) -> list[dict[str, Any]]:
    return compare(metric_values(live_report), metric_values(sim_report))


def compare(
    live_values: list[float | None],
    sim_values: list[float | None],
    sim_ranges: list[tuple[float, float] | None] | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for k, ((dist, stat), a, b) in enumerate(zip(METRICS, live_values, sim_values)):
        err = None if a is None or b is None or a == 0 else (b - a) / a
        row = {"metric": f"{dist.split('_')[0].upper()} {stat} (ms)", "live": a, "sim": b, "rel_error": err}
        if sim_ranges is not None:
            row["sim_range"] = sim_ranges[k]
        rows.append(row)
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    ranged = any(r.get("sim_range") for r in rows)
    lines = [
        f"{'metric':<16}{'live mesh':>12}{'simulator':>12}{'sim error':>12}" + ("   sim over seeds" if ranged else "")
    ]
    for r in rows:
        live_s = "-" if r["live"] is None else f"{r['live']:.2f}"
        sim_s = "-" if r["sim"] is None else f"{r['sim']:.2f}"
        err_s = "-" if r["rel_error"] is None else f"{r['rel_error'] * 100:+.1f}%"
        span = r.get("sim_range")
        extra = f"   {span[0]:.2f}-{span[1]:.2f}" if span else ""
        lines.append(f"{r['metric']:<16}{live_s:>12}{sim_s:>12}{err_s:>12}{extra}")
    return "\n".join(lines)


def _verdict(rows: list[dict[str, Any]]) -> tuple[float | None, str]:
    errs = [abs(r["rel_error"]) for r in rows if r["rel_error"] is not None]
    worst = max(errs) if errs else None
    verdict = "-" if worst is None else ("within" if worst <= GOAL_REL_ERROR else "outside")
    return (
        worst,
        f"worst error {'-' if worst is None else f'{worst * 100:.1f}%'} ({verdict} the {GOAL_REL_ERROR:.0%} goal)",
    )


def over_seeds(per_seed: list[list[float | None]]) -> tuple[list[float | None], list[tuple[float, float] | None]]:
    """Median and (min, max) of each metric over the seeds."""
    medians, ranges = [], []
    for k in range(len(METRICS)):
        xs = [v[k] for v in per_seed if v[k] is not None]
        medians.append(statistics.median(xs) if xs else None)
        ranges.append((min(xs), max(xs)) if xs else None)
    return medians, ranges


def report_sessions(args: argparse.Namespace, table: DeviceSpec, sessions: list[Session]) -> None:
    """Pool the sessions' evaluation rows; print the simulator against the live mesh (bare table, then the
    service model over the seeds), the live spread and the path breakdown; write the files of --out."""
    live_eval = [r for s in sessions for r in split_rows(s.live)[0]]
    bare_eval = [r for s in sessions for r in split_rows(s.bare)[0]]
    service_by_seed = [[r for s in sessions for r in s.service[seed]] for seed in range(args.seeds)]
    live_report = summarize(live_eval)
    print(
        f"live: {live_report.overall.succeeded}/{live_report.overall.requests} evaluation requests succeeded "
        f"({args.sessions} session(s))"
    )
    rows = side_by_side(live_report, summarize(bare_eval))
    worst, text = _verdict(rows)
    print(f"simulator on the device table alone ({table.source[:60]}...):")
    print(format_rows(rows))
    print(text)
    # The simulator's figure is over all seeds' records pooled: an estimate of the model's own percentile, as
    # the live one is of the mesh's (one seed's p90 over a heavy-tailed path rests on a handful of draws);
    # the range over single seeds is printed beside it.
    per_seed = [metric_values(summarize(records)) for records in service_by_seed]
    _, ranges = over_seeds(per_seed)
    pooled = metric_values(summarize([r for records in service_by_seed for r in records]))
    service_rows = compare(metric_values(live_report), pooled, ranges)
    service_worst, text = _verdict(service_rows)
    print(f"simulator on the table + each session's measured service model ({args.seeds} seeds pooled):")
    print(format_rows(service_rows))
    print(text)
    spread = bootstrap_intervals(live_eval)
    print(
        "live figures' own sampling spread (5-95% over resamples of the evaluation requests): "
        + ", ".join(
            r["metric"].split(" (")[0] + " " + ("-" if iv is None else f"{iv[0]:.2f}-{iv[1]:.2f}")
            for r, iv in zip(service_rows, spread)
        )
    )
    breakdown = [row for s in sessions for row in path_breakdown(s.logs, s.spans, s.wall0_ms)]
    if breakdown:
        bare_all = [r for s in sessions for r in s.bare]
        print(format_breakdown(breakdown))
        print(
            "  simulated on the bare table, same requests: engine TTFT p50/p90 "
            + "/".join(f"{percentile([r.ttft_ms for r in bare_all if r.ttft_ms is not None], q):.2f}" for q in (50, 90))
            + ", engine time of a request (arrival to last token) p50/p90 "
            + "/".join(
                f"{percentile([r.finish_ms - r.send_ms for r in bare_all if r.finish_ms is not None], q):.2f}"
                for q in (50, 90)
            )
        )
    if args.out:
        write_outputs(
            args,
            table,
            sessions,
            live_report,
            live_eval,
            bare_eval,
            service_by_seed[0],
            breakdown,
            {
                "rows": rows,
                "worst_rel_error": worst,
                "service_rows": service_rows,
                "service_worst_rel_error": service_worst,
                "service_per_seed": per_seed,
                "live_spread": spread,
            },
        )


def write_outputs(
    args: argparse.Namespace,
    table: DeviceSpec,
    sessions: list[Session],
    live_report: Report,
    live_eval: list,
    bare_eval: list,
    service_eval: list,
    breakdown: list[dict],
    figures: dict[str, Any],
) -> None:
    out = args.out
    meta = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "device_table": dataclasses.asdict(table),
        "wall0_unix_ms": [s.wall0_ms for s in sessions],
    }
    for s in sessions:
        d = out / f"session-{s.index}"
        evaluation, calibration = split_rows(s.live)
        write_all(summarize(evaluation), evaluation, d / "live", meta, log_rows=s.logs[0::2])
        write_all(summarize(calibration), calibration, d / "live-calibration", meta, log_rows=s.logs[1::2])
        if s.spans:
            (d / "spans.jsonl").write_text("".join(json.dumps(sp) + "\n" for sp in s.spans))
    write_all(live_report, live_eval, out / "live", meta)
    write_all(summarize(bare_eval), bare_eval, out / "sim", meta)
    write_all(summarize(service_eval), service_eval, out / "sim-service", meta)
    if breakdown:
        with (out / "path.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["request_id", *PATH_PARTS])
            writer.writeheader()
            writer.writerows(breakdown)
    table_rows = per_request_rows(live_eval, bare_eval, service_eval)
    with (out / "requests.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table_rows[0]))
        writer.writeheader()
        writer.writerows(table_rows)
    calibrations = [
        {
            "service_model": dataclasses.asdict(s.calibration.model),
            "ratios_tried": s.ratios_tried,
            **{k: v for k, v in dataclasses.asdict(s.calibration).items() if k != "model"},
        }
        for s in sessions
    ]
    (out / "fidelity.json").write_text(
        json.dumps({**meta, **figures, "calibrations": calibrations}, indent=2, default=str) + "\n"
    )
