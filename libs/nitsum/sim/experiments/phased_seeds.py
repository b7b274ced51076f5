"""`sim tiers --phased-seeds N`: the phased load's figures per seed and their means. Near a table's capacity a
phase's goodput turns on the backlog it inherits, so one seed's phased ratio can be far from the load's."""

from __future__ import annotations

from typing import Any

from nitsum.sim.experiments.common import md_table, ratio_text


def phase_wg(ph: dict[str, Any], policy: str) -> float | None:
    """A policy's weighted goodput over the whole phased load (`tiers.run_phased`'s result)."""
    return next((r["weighted_goodput_rps"] for r in ph["rows"] if r["policy"] == policy), None)


def phased_over_seeds(phased_runs: list[tuple[int, dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per (seed, `run_phased` result): its best static layout, the per-phase oracle, adaptive and the
    ratios; and the means of the ratios (None where a seed has none)."""
    rows = []
    for s, ph in phased_runs:
        best = ph["best_static"]
        rows.append(
            {
                "seed": s,
                "best_static": best["policy"] if best else None,
                "best_static_wg": best["weighted_goodput_rps"] if best else None,
                "oracle_wg": ph["oracle"],
                "adaptive_wg": phase_wg(ph, "adaptive"),
                "adaptive_vs_best_static": ph["adaptive_vs_best_static"],
                "adaptive_vs_tp8": ph["adaptive_vs_tp8"],
                "oracle_vs_best_static": ph["oracle_vs_best_static"],
            }
        )

    def mean(key: str) -> float | None:
        values = [r[key] for r in rows]
        return None if not values or None in values else sum(values) / len(values)

    ratios = [r["adaptive_vs_best_static"] for r in rows if r["adaptive_vs_best_static"] is not None]
    return rows, {
        "adaptive_vs_best_static": mean("adaptive_vs_best_static"),
        "adaptive_vs_tp8": mean("adaptive_vs_tp8"),
        "oracle_vs_best_static": mean("oracle_vs_best_static"),
        "min_adaptive_vs_best_static": min(ratios, default=None),
    }


def seeds_markdown(rows: list[dict[str, Any]], mean: dict[str, Any]) -> list[str]:
    """The "Phased over N seeds" section of tiers.md."""
    return [
        f"## Phased over {len(rows)} seeds ({rows[0]['seed']}-{rows[-1]['seed']})",
        "",
        f"Mean adaptive / best static {ratio_text(mean['adaptive_vs_best_static'])}x (lowest "
        f"{ratio_text(mean['min_adaptive_vs_best_static'])}x; goal 1.5), mean adaptive / TP8 "
        f"{ratio_text(mean['adaptive_vs_tp8'])}x (goal 3), mean oracle / best static "
        f"{ratio_text(mean['oracle_vs_best_static'])}x.",
        "",
        md_table(rows, list(rows[0])),
        "",
    ]
