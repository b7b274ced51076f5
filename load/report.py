"""Report outputs of a load run: terminal table, JSON, CSV, the lifecycle log and PNG plots.

The numbers come from `nitsum.metrics.summarize` (the simulator's and coordinator's metric code); this
module only formats them. Files written by `write_all` into the output directory:

    summary.json     {"meta": run settings, "report": Report.to_dict()}
    summary.csv      one row per tier plus one for all requests (flat columns)
    requests.jsonl   the lifecycle log: one RequestRecord.to_dict() per line (+ client-only fields)
    latency_cdf.png  TTFT and TPOT CDFs per tier with the tier's target marked
    timeline.png     TTFT of each request over its send time, and goodput per second
    attainment.png   SLO / TTFT / TPOT attainment per tier
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nitsum.metrics import Distribution, Report, RequestRecord, TierSummary

FILES = ("summary.json", "summary.csv", "requests.jsonl", "latency_cdf.png", "timeline.png", "attainment.png")
SCALARS = (
    "requests",
    "succeeded",
    "failed",
    "unfinished",
    "slo_met",
    "ttft_met",
    "tpot_met",
    "slo_attainment",
    "ttft_attainment",
    "tpot_attainment",
    "goodput_rps",
    "weighted_goodput_rps",
    "throughput_rps",
    "output_tokens_per_s",
)
DISTS = ("ttft_ms", "tpot_ms", "itl_ms")
DIST_FIELDS = ("count", "mean", "p50", "p90", "p99", "max")
CSV_COLUMNS = ("tier",) + SCALARS + tuple(f"{d}_{f}" for d in DISTS for f in DIST_FIELDS) + ("errors",)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _triple(d: Distribution) -> str:
    return "/".join(_fmt(v, 0 if v is not None and v >= 100 else 1) for v in (d.p50, d.p90, d.p99))


def format_errors(errors: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(errors.items())) or "-"


def format_table(report: Report) -> str:
    """A fixed-width table, one row per tier and one for all requests."""
    header = (
        "tier",
        "reqs",
        "ok",
        "SLO met",
        "goodput/s",
        "w.goodput/s",
        "TTFT p50/p90/p99 ms",
        "TPOT p50/p90/p99 ms",
        "errors",
    )
    rows = [header]
    for s in [*report.tiers.values(), report.overall]:
        rows.append(
            (
                s.tier,
                str(s.requests),
                str(s.succeeded),
                _pct(s.slo_attainment),
                _fmt(s.goodput_rps, 2),
                _fmt(s.weighted_goodput_rps, 2),
                _triple(s.ttft_ms),
                _triple(s.tpot_ms),
                format_errors(s.errors),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for n, r in enumerate(rows):
        cells = [c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"window {report.duration_s:.2f} s")
    return "\n".join(lines)


def csv_row(s: TierSummary) -> dict[str, Any]:
    d = s.to_dict()
    row: dict[str, Any] = {"tier": s.tier}
    row.update({k: d[k] for k in SCALARS})
    for dist in DISTS:
        for f in DIST_FIELDS:
            row[f"{dist}_{f}"] = d[dist][f]
    row["errors"] = ";".join(f"{k}={v}" for k, v in sorted(s.errors.items()))
    return row


def write_csv(report: Report, path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for s in [*report.tiers.values(), report.overall]:
            w.writerow({k: ("" if v is None else v) for k, v in csv_row(s).items()})


def write_json(report: Report, path: Path, meta: Mapping[str, Any]) -> None:
    path.write_text(
        json.dumps({"meta": dict(meta), "report": report.to_dict()}, indent=2, sort_keys=False) + "\n", encoding="utf-8"
    )


def write_lifecycle_log(rows: Iterable[Mapping[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dict(row), separators=(",", ":")) + "\n")


def read_lifecycle_log(path: Path) -> list[RequestRecord]:
    """Records from a lifecycle log (extra client-only fields are ignored)."""
    out = []
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(RequestRecord.from_dict(json.loads(line)))
                except (KeyError, ValueError, TypeError) as exc:
                    raise ValueError(f"{path}:{line_no}: not a lifecycle record: {exc}") from exc
    return out


def _by_tier(records: Sequence[RequestRecord], report: Report) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {t: [] for t in report.tiers}
    for r in records:
        groups.setdefault(r.tier, []).append(r)
    return groups


def goodput_bin_s(duration_s: float) -> float:
    """Bin width for the goodput timeline: about 40 bins, rounded to 1/2/5 x 10^k seconds, at least 0.1 s."""
    target = max(0.1, duration_s / 40.0)
    k = math.floor(math.log10(target))
    for m in (1, 2, 5, 10):
        if m * 10**k >= target:
            return float(m * 10**k)
    raise AssertionError("unreachable: 10 * 10^k >= target by the choice of k")


def write_plots(records: Sequence[RequestRecord], report: Report, out_dir: Path) -> list[Path]:
    # The object-oriented API (Figure, no pyplot) never touches a GUI backend or global figure state.
    from matplotlib.figure import Figure

    groups = _by_tier(records, report)
    paths = []

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_ttft, ax_tpot = fig.subplots(1, 2)
    for tier, recs in groups.items():
        for ax, values, target in (
            (ax_ttft, [r.ttft_ms for r in recs if r.ttft_ms is not None], recs[0].ttft_slo_ms if recs else None),
            (
                ax_tpot,
                [r.tpot_ms for r in recs if r.succeeded and r.tpot_ms is not None],
                recs[0].tpot_slo_ms if recs else None,
            ),
        ):
            xs = sorted(values)
            if xs:
                (line,) = ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=tier)
                if target is not None:
                    ax.axvline(target, color=line.get_color(), linestyle="--", linewidth=0.8)
    for ax, name in ((ax_ttft, "TTFT"), (ax_tpot, "TPOT")):
        # Log x: latencies span milliseconds to the 10 s background target.
        if ax.has_data():
            ax.set_xscale("log")
            ax.legend(loc="lower right")
        ax.set_xlabel(f"{name} (ms, log; dashed = tier target)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3, which="both")
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=100)

    fig = Figure(figsize=(11, 6), layout="constrained")
    ax_lat, ax_good = fig.subplots(2, 1, sharex=True)
    start_ms = min((r.send_ms for r in records), default=0.0)
    bin_s = goodput_bin_s(report.duration_s)
    num_bins = max(1, math.ceil(report.duration_s / bin_s))
    edges = [i * bin_s for i in range(num_bins + 1)]
    for tier, recs in groups.items():
        ok = [r for r in recs if r.ttft_ms is not None]
        if ok:
            ax_lat.scatter([(r.send_ms - start_ms) / 1000 for r in ok], [r.ttft_ms for r in ok], s=8, label=tier)
        counts = [0] * num_bins
        for r in recs:
            if r.slo_met:
                counts[min(num_bins - 1, int((r.finish_ms - start_ms) / 1000 / bin_s))] += 1
        ax_good.stairs([n / bin_s for n in counts], edges, label=tier)
    failed = [r for r in records if r.outcome != "ok"]
    for r in failed:
        ax_lat.axvline((r.send_ms - start_ms) / 1000, color="red", alpha=0.15, linewidth=0.8)
    ax_lat.set_ylabel("TTFT (ms); red = failed")
    ax_lat.set_title("TTFT by send time")
    ax_lat.grid(alpha=0.3)
    ax_good.set_ylabel(f"goodput (req/s, {bin_s:g} s bins)")
    ax_good.set_xlabel("seconds since the first send")
    ax_good.grid(alpha=0.3)
    for ax in (ax_lat, ax_good):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right")
    paths.append(out_dir / "timeline.png")
    fig.savefig(paths[-1], dpi=100)

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    summaries = [*report.tiers.values(), report.overall]
    names = [s.tier for s in summaries]
    width = 0.27
    for k, (label, attr) in enumerate(
        (("SLO", "slo_attainment"), ("TTFT", "ttft_attainment"), ("TPOT", "tpot_attainment"))
    ):
        ax.bar(
            [i + (k - 1) * width for i in range(len(names))],
            [getattr(s, attr) or 0.0 for s in summaries],
            width,
            label=label,
        )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction of requests meeting target")
    ax.set_title("SLO attainment (failed requests count as misses)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3, axis="y")
    paths.append(out_dir / "attainment.png")
    fig.savefig(paths[-1], dpi=100)
    return paths


def write_all(
    report: Report,
    records: Sequence[RequestRecord],
    out_dir: Path,
    meta: Mapping[str, Any],
    log_rows: Iterable[Mapping[str, Any]] | None = None,
) -> dict[str, Path]:
    """Write every report file into out_dir (created if missing); returns name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in FILES}
    write_json(report, paths["summary.json"], meta)
    write_csv(report, paths["summary.csv"])
    write_lifecycle_log(log_rows if log_rows is not None else (r.to_dict() for r in records), paths["requests.jsonl"])
    write_plots(records, report, out_dir)
    return paths
