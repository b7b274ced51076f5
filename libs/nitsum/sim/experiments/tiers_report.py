"""`sim tiers`' report pieces: the sweep's plot, the per-rate summary table and the phased load's section of
tiers.md (tiers.py runs the experiments and assembles the report from these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nitsum.sim.experiments.common import md_table, plot_lines, ratio_text
from nitsum.sim.experiments.phased_seeds import phase_wg
from nitsum.workloads import Phase


def plot_sweep(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Weighted goodput against the arrival rate, a panel per cluster size: adaptive, TP8 and every layout that is
    the best static one at some rate."""
    panels = []
    for n in sorted({r["nodes"] for r in rows}):
        sub = [r for r in rows if r["nodes"] == n]
        shown = ["adaptive", "static:8"] + sorted({r["best_static"] for r in sub if r["best_static"]} - {"static:8"})
        series_g = {
            p: (
                [r["rate_rps"] for r in sub if r["policy"] == p],
                [r["weighted_goodput_rps"] for r in sub if r["policy"] == p],
            )
            for p in shown
        }
        panels.append(
            {"xlabel": f"arrival rate (req/s), {n} node(s)", "ylabel": "weighted goodput", "series": series_g}
        )
    plot_lines(path, panels, title)


def rate_summary(rows: list[dict[str, Any]], rates) -> list[dict[str, Any]]:
    """One row per single-node rate: adaptive, the best static layout in hindsight, TP8 and the ratios."""
    summary = []
    for rate in rates:
        at = {r["policy"]: r for r in rows if r["nodes"] == 1 and r["rate_rps"] == rate}
        a, t8 = at["adaptive"], at.get("static:8")
        summary.append(
            {
                "rate_rps": rate,
                "adaptive_wg": a["weighted_goodput_rps"],
                "best_static": a["best_static"],
                "best_static_wg": a["best_static_weighted_goodput_rps"],
                "adaptive_vs_best_static": a["vs_best_static"],
                "tp8_wg": t8["weighted_goodput_rps"] if t8 else None,
                "adaptive_vs_tp8": a["weighted_goodput_rps"] / t8["weighted_goodput_rps"]
                if t8 and t8["weighted_goodput_rps"]
                else None,
                "adaptive_changes": a["reconfigurations"],
            }
        )
    return summary


def phased_markdown(phases: tuple[Phase, ...], ph: dict[str, Any]) -> list[str]:
    """The "Phased" section of tiers.md (`tiers.run_phased`'s result)."""
    return [
        "## Phased: "
        + ", ".join(
            f"{p.name} {p.duration_s:g} s at {p.rate_per_s:g} req/s, {p.interactive_fraction:.0%} interactive"
            for p in phases
        ),
        f"(interactive lengths `{ph['paths'][0].name}`, background `{ph['paths'][1].name}`)",
        "",
        f"Adaptive {ratio_text(phase_wg(ph, 'adaptive'))} weighted req/s; best static {ph['best_static']['policy']} "
        f"{ratio_text(ph['best_static']['weighted_goodput_rps'])}; per-phase oracle {ratio_text(ph['oracle'])} "
        f"({', '.join(f'{k}: {v[0]}' for k, v in ph['oracle_parts'].items())}); adaptive / best static "
        f"{ratio_text(ph['adaptive_vs_best_static'])}x (goal 1.5), adaptive / TP8 {ratio_text(ph['adaptive_vs_tp8'])}x (goal 3), "
        f"oracle / best static {ratio_text(ph['oracle_vs_best_static'])}x.",
        "",
        md_table(ph["rows"], list(ph["rows"][0])),
        "",
        f"Adaptive layout changes (s, layout): {ph['timeline'].get('changes')}",
        "",
        f"Per phase (changes inside, mean TP at start, at end): {ph['timeline'].get('per_phase')}",
        "",
    ]
