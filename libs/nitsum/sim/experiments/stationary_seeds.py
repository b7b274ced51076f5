"""`sim tiers --stationary-seeds N`: the stationary sweep's single-node points on N seeds. Near a table's capacity
which static layout is best in hindsight turns on the arrival realisation (one seed's Poisson draws), so beside
each seed's best layout in hindsight this reports the layout that is best for the load: the highest mean over the
seeds, the one static layout an operator could have chosen for that rate. Beside it, the bound of an online
controller that boots as adaptive does (`BootThenStatic`): what the best layout for the load gets when it is
reached only at adaptive's first decision."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nitsum.policy.base import PolicyConfig
from nitsum.policy.baselines import StaticLayout
from nitsum.policy.decisions import TopologyDecision
from nitsum.policy.snapshot import ClusterSnapshot, NodeView
from nitsum.policy.topology import AdaptivePolicy
from nitsum.sim.experiments.common import md_table, ratio_text
from nitsum.topology import Topology


class BootThenStatic(StaticLayout):
    """Boots on adaptive's layout and, at the first epoch whose snapshot carries measured arrivals (where adaptive
    makes its first decision), moves to `layout` for good: what a controller that knew the best layout for the load
    in hindsight, but had to see the load before acting, would get."""

    def __init__(self, layout: str, config: PolicyConfig | None = None) -> None:
        super().__init__(layout, config)
        self.boot = AdaptivePolicy(config)
        self.name = f"boot-then:{self.name}"
        self.left_boot = False

    def initial_topology(self, node: NodeView) -> Topology:
        return super().initial_topology(node) if self.left_boot else self.boot.initial_topology(node)

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        if not self.left_boot and not snap.arrivals:
            return []
        self.left_boot = True
        return self._keep_static(snap)


def stationary_over_seeds(
    sweeps: list[tuple[int, list[dict[str, Any]]]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """From (seed, `tiers.sweep` rows) pairs: one row per (seed, rate) with that seed's best static layout in
    hindsight and adaptive's ratio to it; and one row per rate over the seeds: the distinct best layouts in
    hindsight, the static layout with the highest mean weighted goodput, adaptive's mean and the ratios."""
    per_seed: list[dict[str, Any]] = []
    by_rate: dict[float, dict[str, list[float]]] = {}
    for s, rows in sweeps:
        for r in rows:
            if r["nodes"] != 1:
                continue
            by_rate.setdefault(r["rate_rps"], {}).setdefault(r["policy"], []).append(r["weighted_goodput_rps"])
            if r["policy"] == "adaptive":
                per_seed.append(
                    {
                        "seed": s,
                        "rate_rps": r["rate_rps"],
                        "best_static": r["best_static"],
                        "best_static_wg": r["best_static_weighted_goodput_rps"],
                        "adaptive_wg": r["weighted_goodput_rps"],
                        "adaptive_vs_best_static": r["vs_best_static"],
                    }
                )
    summary = []
    for rate, wgs in by_rate.items():
        means = {p: sum(v) / len(v) for p, v in wgs.items()}
        statics = {p: m for p, m in means.items() if p.startswith("static:")}
        best = max(statics, key=lambda p: statics[p]) if statics else None
        mine = [r for r in per_seed if r["rate_rps"] == rate]
        ratios = [r["adaptive_vs_best_static"] for r in mine if r["adaptive_vs_best_static"] is not None]
        adaptive = means.get("adaptive")
        summary.append(
            {
                "rate_rps": rate,
                "seeds": len(mine),
                "best_in_hindsight": " ".join(dict.fromkeys(str(r["best_static"]) for r in mine)),
                "best_for_the_load": best,
                "best_for_the_load_mean_wg": statics[best] if best else None,
                "adaptive_mean_wg": adaptive,
                "adaptive_vs_best_for_the_load": adaptive / statics[best]
                if best and adaptive is not None and statics[best]
                else None,
                "mean_adaptive_vs_best_in_hindsight": sum(ratios) / len(ratios) if ratios else None,
                "min_adaptive_vs_best_in_hindsight": min(ratios, default=None),
            }
        )
    return per_seed, summary


def add_boot_bound(
    summary: list[dict[str, Any]], seeds: list[int], boot_then: Callable[[str, float, int], float]
) -> None:
    """Add to each rate's row the mean over `seeds` of `boot_then(layout, rate, seed)` (the weighted goodput of
    `BootThenStatic` for the layout best for the load, without its `static:`) and its ratio to that layout's."""
    for row in summary:
        layout = row["best_for_the_load"]
        wgs = [boot_then(layout.partition(":")[2], row["rate_rps"], s) for s in seeds] if layout else []
        mean = sum(wgs) / len(wgs) if wgs else None
        best = row["best_for_the_load_mean_wg"]
        row["boot_then_best_mean_wg"] = mean
        row["boot_then_best_vs_best_for_the_load"] = mean / best if mean is not None and best else None


def stationary_markdown(per_seed: list[dict[str, Any]], summary: list[dict[str, Any]]) -> list[str]:
    """The "Stationary over N seeds" section of tiers.md."""
    seeds = sorted({r["seed"] for r in per_seed})
    worst = min(
        (r for r in summary if r["adaptive_vs_best_for_the_load"] is not None),
        key=lambda r: r["adaptive_vs_best_for_the_load"],
        default=None,
    )
    head = (
        f"Adaptive's mean / the best static layout's mean: worst {ratio_text(worst['adaptive_vs_best_for_the_load'])}x "
        f"at {worst['rate_rps']} req/s (goal >= 0.97 everywhere)."
        if worst
        else "No point has a static layout with goodput."
    )
    return [
        f"## Stationary over {len(seeds)} seeds ({seeds[0]}-{seeds[-1]})",
        "",
        head + " `best_in_hindsight`: each seed's best static layout, in seed order (repeats left out); "
        "`best_for_the_load`: the static layout with the highest mean over the seeds; `boot_then_best`: that "
        "layout booted as adaptive boots and reached at adaptive's first decision (the bound of a controller that "
        "must see the load first).",
        "",
        md_table(summary, list(summary[0])),
        "",
    ]
