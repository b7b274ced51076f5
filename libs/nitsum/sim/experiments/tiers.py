"""`nitsum sim tiers`: Nitsum's setting. Llama-3-70B on 8xH100 (or what `--device-table` holds), interactive
(TTFT 200 ms, TPOT 25 ms, weight 10) and background (weight 1) tiers; adaptive against EVERY static layout of
an 8-device node that fits the model (baselines.static_layouts: all aligned all-hybrid partitions, every P/D
split with prefill and decode groups of one size each), with the best static layout in hindsight per point.

Two workloads:
- stationary: Poisson arrivals, 30 % interactive, Azure-conv lengths, rate swept (as before);
- phased (PHASES, fixed before any policy tuning; docs/SIMULATOR.md): an interactive surge, a background batch
  window, a mixed period and a second surge. Interactive lengths from the Azure 2023 *code* trace (long
  prompts, short answers), background lengths from ServeGen (`servegen-mm-image`, the ServeGen archive
  committed as an excerpt). Reported per phase, with the per-phase oracle: the best static layout of each
  phase, switched between phases for free.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from nitsum.policy.baselines import layout_name, static_layouts
from nitsum.policy.topology import mean_tp
from nitsum.sim.cluster import ClusterConfig, ClusterResult, run_cluster
from nitsum.sim.experiments.common import Progress, md_table, ratio_text, table_target, write_csv
from nitsum.sim.experiments.phased_seeds import phased_over_seeds, seeds_markdown
from nitsum.sim.experiments.stationary_seeds import (
    BootThenStatic,
    add_boot_bound,
    stationary_markdown,
    stationary_over_seeds,
)
from nitsum.sim.experiments.tiers_report import phased_markdown, plot_sweep, rate_summary
from nitsum.workloads import (
    Phase,
    assign_tiers,
    default_trace_path,
    is_excerpt,
    phase_bounds,
    phased,
    poisson,
    read_azure,
    servegen_arrivals,
)

TIER_MIX = {"interactive": 0.3, "background": 0.7}
RATES = (1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 20.0)
# The phased workload. Fixed (docs/SIMULATOR.md, "Phased workload") before the policy was tuned against it.
PHASES = (
    Phase("surge", 60.0, 8.0, 0.9),
    Phase("batch", 60.0, 20.0, 0.05),
    Phase("mixed", 60.0, 12.0, 0.5),
    Phase("surge2", 60.0, 8.0, 0.9),
)
INTERACTIVE_TRACE = "azure-code"
BACKGROUND_TRACE = "servegen-mm-image"


def workload(rate_per_s: float, duration_s: float, seed: int):
    trace_path = default_trace_path("azure-conv")
    lengths = read_azure(trace_path)
    reqs = poisson(rate_per_s, duration_s=duration_s, seed=seed, lengths=lengths)
    return assign_tiers(reqs, TIER_MIX, seed=seed), trace_path


def phased_workload(phases: tuple[Phase, ...] = PHASES, seed: int = 0, prefer_excerpt: bool = False):
    """`prefer_excerpt`: the committed excerpts even where the real traces exist (a scenario CI runs alike)."""
    inter_path = default_trace_path(INTERACTIVE_TRACE, prefer_excerpt=prefer_excerpt)
    back_path = default_trace_path(BACKGROUND_TRACE, prefer_excerpt=prefer_excerpt)
    inter = read_azure(inter_path)
    back = servegen_arrivals(back_path, duration_s=600.0, seed=seed, tier="background")
    return phased(phases, inter, back, seed=seed), (inter_path, back_path)


def fitting_static_policies(config: ClusterConfig) -> list[str]:
    """`static:<layout>` for every static layout of a node whose groups all hold the model's weights."""
    cost = config.cost_model()
    levels = tuple(
        k for k in (1, 2, 4, 8, 16, 32) if config.min_tp <= k <= config.max_tp and k <= config.devices_per_node
    )
    out = []
    for layout in static_layouts(config.devices_per_node, levels):
        if all(cost.fits(tp) for tp, _ in layout):
            out.append(f"static:{layout_name(layout)}")
    return out


def node_prefill_capacity(config: ClusterConfig, prompt_tokens: int = 1000) -> float:
    """Prompt tokens per ms a node prefills at its best uniform layout (groups of one TP that fit)."""
    cost = config.cost_model()
    best = 0.0
    for tp in (1, 2, 4, 8, 16, 32):
        if tp <= config.devices_per_node and config.min_tp <= tp <= config.max_tp and cost.fits(tp):
            best = max(best, config.devices_per_node // tp * prompt_tokens / cost.prefill_time_ms(tp, prompt_tokens))
    return best


def load_scale(config: ClusterConfig) -> float:
    """How much faster (> 1) or slower this node prefills than the data-sheet H100 node with Llama-3-70B that the
    rates were chosen for: with a device table, every rate is multiplied by it (the same load relative to
    the node), so the sweep and the phases test the same regimes on another device or model."""
    return node_prefill_capacity(config) / node_prefill_capacity(ClusterConfig())


def row_of(policy: str, rate: float, nodes: int, res: ClusterResult) -> dict[str, Any]:
    rep = res.report
    inter = rep.tiers.get("interactive")
    back = rep.tiers.get("background")
    return {
        "policy": policy,
        "nodes": nodes,
        "rate_rps": rate,
        "requests": rep.overall.requests,
        "goodput_rps": rep.overall.goodput_rps,
        "weighted_goodput_rps": rep.overall.weighted_goodput_rps,
        "slo_attainment": rep.overall.slo_attainment,
        "interactive_attainment": inter.slo_attainment if inter else None,
        "background_attainment": back.slo_attainment if back else None,
        "interactive_p99_ttft_ms": inter.ttft_ms.p99 if inter else None,
        "interactive_p99_tpot_ms": inter.tpot_ms.p99 if inter else None,
        "rejected": sum(v for k, v in rep.overall.errors.items() if k.startswith("http_")),
        "shed": rep.overall.errors.get("shed", 0),
        "reconfigurations": res.reconfigurations,
        "events": res.events,
        "wall_s": res.wall_s,
    }


def add_best_static(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (nodes, rate): the best static layout in hindsight (highest weighted goodput among the `static:`
    runs) on every row of that point, and each row's ratio to it."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if r["policy"].startswith("static:"):
            key = (r["nodes"], r["rate_rps"])
            if key not in best or r["weighted_goodput_rps"] > best[key]["weighted_goodput_rps"]:
                best[key] = r
    for r in rows:
        b = best.get((r["nodes"], r["rate_rps"]))
        r["best_static"] = b["policy"] if b else None
        r["best_static_weighted_goodput_rps"] = b["weighted_goodput_rps"] if b else None
        r["vs_best_static"] = (
            r["weighted_goodput_rps"] / b["weighted_goodput_rps"] if b and b["weighted_goodput_rps"] else None
        )
    return rows


def sweep(
    policies, rates, nodes: int, duration_s: float, seed: int, progress: Progress, config: ClusterConfig
) -> list[dict[str, Any]]:
    rows = []
    for rate in rates:
        reqs, _ = workload(rate * nodes, duration_s, seed)
        for policy in policies:
            res = run_cluster(policy, config, reqs)
            rows.append(row_of(policy, rate * nodes, nodes, res))
            progress.step(f"{policy} @ {rate * nodes:g} req/s", res.sim_ms / 1000.0, res.events)
    return add_best_static(rows)


def phase_goodput(res: ClusterResult, phases: tuple[Phase, ...]) -> dict[str, float]:
    """Weighted goodput (weighted req/s meeting SLO) of the requests that arrived in each phase."""
    out = {}
    for name, start, end in phase_bounds(phases):
        met = sum(r.weight for r in res.records if start <= r.send_ms < end and r.slo_met)
        out[name] = met / ((end - start) / 1000.0)
    return out


def layout_per_phase(res: ClusterResult, phases: tuple[Phase, ...]) -> dict[str, tuple[int, float, float]]:
    """Per phase: (layout changes inside it, mean TP at its start, mean TP at its end) on node n0."""
    changes = [(t, topo) for t, node, topo in res.layouts if node == "n0"]
    out = {}
    for name, start, end in phase_bounds(phases):
        at_start = [topo for t, topo in changes if t <= start][-1]
        at_end = [topo for t, topo in changes if t < end][-1]
        inside = sum(1 for t, _ in changes if start < t < end)
        out[name] = (inside, mean_tp(at_start.shape()), mean_tp(at_end.shape()))
    return out


def run_phased(
    policies: list[str],
    phases: tuple[Phase, ...],
    seed: int,
    progress: Progress,
    config: ClusterConfig,
    reqs: list | None = None,
) -> dict[str, Any]:
    """Every policy on a phased load (`reqs`, or the phases drawn from `phased_workload`), scored per phase."""
    paths = None
    if reqs is None:
        reqs, paths = phased_workload(phases, seed)
    total_s = sum(p.duration_s for p in phases)
    rows, per_phase, timeline = [], {}, {}
    for policy in policies:
        res = run_cluster(policy, config, reqs)
        pg = phase_goodput(res, phases)
        per_phase[policy] = pg
        rows.append(
            {
                "policy": policy,
                "weighted_goodput_rps": sum(pg[p.name] * p.duration_s for p in phases) / total_s,
                **{f"{k}_wg": v for k, v in pg.items()},
                "reconfigurations": res.reconfigurations,
            }
        )
        if policy == "adaptive":
            timeline = {
                "changes": [(round(t / 1000.0, 1), str(topo)) for t, node, topo in res.layouts if node == "n0"],
                "per_phase": layout_per_phase(res, phases),
            }
        progress.step(f"phased {policy}", res.sim_ms / 1000.0, res.events)
    statics = [r for r in rows if r["policy"].startswith("static:")]
    best = max(statics, key=lambda r: r["weighted_goodput_rps"]) if statics else None
    oracle_parts = {}
    for p in phases:
        top = max(statics, key=lambda r: r[f"{p.name}_wg"]) if statics else None
        oracle_parts[p.name] = (top["policy"], top[f"{p.name}_wg"]) if top else (None, 0.0)
    oracle = sum(oracle_parts[p.name][1] * p.duration_s for p in phases) / total_s
    by = {r["policy"]: r for r in rows}
    tp8 = by.get("static:8")
    adaptive = by.get("adaptive")
    return {
        "rows": rows,
        "best_static": best,
        "oracle": oracle,
        "oracle_parts": oracle_parts,
        "paths": paths,
        "timeline": timeline,
        "adaptive_vs_best_static": adaptive["weighted_goodput_rps"] / best["weighted_goodput_rps"]
        if adaptive and best and best["weighted_goodput_rps"]
        else None,
        "adaptive_vs_tp8": adaptive["weighted_goodput_rps"] / tp8["weighted_goodput_rps"]
        if adaptive and tp8 and tp8["weighted_goodput_rps"]
        else None,
        "oracle_vs_best_static": oracle / best["weighted_goodput_rps"]
        if best and best["weighted_goodput_rps"]
        else None,
    }


def headline(rows: list[dict[str, Any]], nodes: int) -> dict[str, Any]:
    """Adaptive against the best static layout: the worst ratio over the sweep (the goal is >= 0.97 at every
    point), and the best ratio against static TP8."""
    ad = [r for r in rows if r["nodes"] == nodes and r["policy"] == "adaptive"]
    tp8 = {r["rate_rps"]: r for r in rows if r["nodes"] == nodes and r["policy"] == "static:8"}
    worst = min((r for r in ad if r["vs_best_static"] is not None), key=lambda r: r["vs_best_static"], default=None)
    vs8 = [
        (r["weighted_goodput_rps"] / tp8[r["rate_rps"]]["weighted_goodput_rps"], r["rate_rps"])
        for r in ad
        if r["rate_rps"] in tp8 and tp8[r["rate_rps"]]["weighted_goodput_rps"]
    ]
    best8 = max(vs8, default=(None, None))
    return {
        "min_vs_best_static": worst["vs_best_static"] if worst else None,
        "min_at_rate_rps": worst["rate_rps"] if worst else None,
        "max_weighted_ratio_vs_tp8": best8[0],
        "at_rate_rps": best8[1],
    }


def run(
    out: Path,
    quick: bool = False,
    seed: int = 0,
    device_table: Path | None = None,
    phased_seeds: int = 1,
    stationary_seeds: int = 1,
) -> dict[str, Any]:
    """`phased_seeds` > 1: the phased load also on seeds seed+1 ... seed+phased_seeds-1, reported per seed and as
    a mean (the sweep and the main phased table stay on `seed`). `stationary_seeds` > 1: the same for the
    single-node stationary sweep, with the static layout best for the load (the highest mean) beside each seed's
    best in hindsight."""
    for name, n in (("phased_seeds", phased_seeds), ("stationary_seeds", stationary_seeds)):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    model, device, table = table_target(device_table, ClusterConfig.model, ClusterConfig.device_kind)
    config = ClusterConfig(model=model, device_kind=device, device_table=table)
    statics = fitting_static_policies(config)
    policies = ["adaptive"] + statics
    scale = load_scale(config) if table is not None else 1.0
    phases = tuple(replace(p, rate_per_s=p.rate_per_s * scale) for p in PHASES)
    if quick:
        rates, duration_s = (2.0, 8.0), 10.0
        phases = tuple(replace(p, duration_s=10.0) for p in phases)
        big_rates, big_nodes, big_duration = (), 0, 0.0
    elif table is not None:
        # Another device/model: many more layouts may fit (31 on 8 devices when TP1 does) at scaled rates;
        # fewer points, shorter, and no 32-node part keep one run within minutes.
        rates, duration_s = (2.0, 8.0, 16.0, 20.0), 30.0
        big_rates, big_nodes, big_duration = (), 0, 0.0
    else:
        rates, duration_s = RATES, 60.0
        big_rates, big_nodes, big_duration = (4.0, 8.0, 12.0), 32, 10.0
    rates = tuple(round(r * scale, 3) for r in rates)
    big_policies = [p for p in ("adaptive", "static:8", "static:4+4") if p == "adaptive" or p in statics]
    total = (
        len(rates) * len(policies) * stationary_seeds
        + len(big_rates) * len(big_policies)
        + len(policies) * phased_seeds
        + (len(rates) * stationary_seeds if stationary_seeds > 1 else 0)
    )
    progress = Progress(total, "sim tiers")
    rows = sweep(policies, rates, 1, duration_s, seed, progress, config)
    stationary_runs = [(seed, rows)] + [
        (s, sweep(policies, rates, 1, duration_s, s, progress, config))
        for s in range(seed + 1, seed + stationary_seeds)
    ]
    stationary_rows, stationary_summary = stationary_over_seeds(stationary_runs)
    if stationary_seeds > 1:

        def boot_then(layout: str, rate: float, s: int) -> float:
            res = run_cluster(BootThenStatic(layout, config.policy_config()), config, workload(rate, duration_s, s)[0])
            progress.step(f"boot-then:{layout} @ {rate:g} req/s", res.sim_ms / 1000.0, res.events)
            return row_of("boot", rate, 1, res)["weighted_goodput_rps"]

        add_boot_bound(stationary_summary, [s for s, _ in stationary_runs], boot_then)
    if big_nodes:
        rows += sweep(
            big_policies, big_rates, big_nodes, big_duration, seed, progress, replace(config, num_nodes=big_nodes)
        )
    ph = run_phased(policies, phases, seed, progress, config)
    runs = [(seed, ph)] + [
        (s, run_phased(policies, phases, s, progress, config)) for s in range(seed + 1, seed + phased_seeds)
    ]
    seed_rows, seed_mean = phased_over_seeds(runs)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "tiers.csv", rows)
    write_csv(out / "tiers_phased.csv", ph["rows"])
    if phased_seeds > 1:
        write_csv(out / "tiers_phased_seeds.csv", seed_rows)
    if stationary_seeds > 1:
        write_csv(out / "tiers_stationary_seeds.csv", stationary_rows)
    plot_sweep(out / "tiers.png", rows, f"{model} on 8x{device} per node, 30% interactive / 70% background")
    _, trace_path = workload(1.0, 1.0, seed)
    head = headline(rows, 1)
    cols = [
        "policy",
        "rate_rps",
        "goodput_rps",
        "weighted_goodput_rps",
        "interactive_attainment",
        "background_attainment",
        "reconfigurations",
        "best_static",
        "best_static_weighted_goodput_rps",
        "vs_best_static",
    ]
    summary = rate_summary(rows, rates)
    source = f"`{device_table}` ({device}, {model})" if device_table else f"data-sheet {device} table"
    md = [
        "# sim tiers",
        "",
        f"{model}, 8 x {device} per node, step times from the {source}; {len(statics)} static layouts fit: "
        f"{', '.join(statics)}. Seed {seed}."
        + (
            f" Rates x {scale:.3g} (this node prefills {scale:.3g} x as fast as "
            f"the data-sheet H100 node with Llama-3-70B)."
            if scale != 1.0
            else ""
        ),
        "",
        f"## Stationary: Poisson, 30% interactive, lengths from `{trace_path.name}`"
        f"{' (committed excerpt)' if is_excerpt(trace_path) else ''}, {duration_s:g} s per point",
        "",
        f"Adaptive / best static (weighted goodput): worst {ratio_text(head['min_vs_best_static'])}x at {head['min_at_rate_rps']} req/s "
        f"(goal >= 0.97 everywhere); best adaptive / TP8: {ratio_text(head['max_weighted_ratio_vs_tp8'])}x at {head['at_rate_rps']} req/s.",
        "",
        md_table(summary, list(summary[0])),
        "",
    ]
    md += phased_markdown(phases, ph)
    if stationary_seeds > 1:
        md += stationary_markdown(stationary_rows, stationary_summary)
    if phased_seeds > 1:
        md += seeds_markdown(seed_rows, seed_mean)
    md += [
        "## All runs",
        "",
        md_table(rows, cols),
        "",
        progress.summary(),
        "",
    ]
    (out / "tiers.md").write_text("\n".join(md), encoding="utf-8")
    return {
        "rows": rows,
        "headline": head,
        "phased": ph,
        "phased_seeds": {"rows": seed_rows, "mean": seed_mean, "runs": runs},
        "stationary_seeds": {"rows": stationary_rows, "summary": stationary_summary, "runs": stationary_runs},
        "summary": summary,
        "speed": progress.summary(),
    }
