"""`nitsum sim estimates`: how well the adaptive policy's estimator ranks the static layouts (issue 17, round nine).

For each stationary point of `sim tiers` (the same workload, table and load scale), every static layout that fits
is run statically (its weighted goodput and, per tier, the fractions served, in time and meeting TPOT), and the
adaptive policy is run with its decisions recorded: at each capture time (`CAPTURE_S`) the snapshot it decided on
is kept, and every static layout is scored on it by the policy's own estimator (`AdaptivePolicy.evaluate_groups`, the
worth `change_worth` it ranks candidates by) with the stream's terms per tier (`stream.StreamTerms`). Reported:
Spearman's rank correlation of the estimate with the simulated goodput over the layouts, the estimator's top
layout against the simulator's, and the terms of both for the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nitsum.policy.baselines import layout_name, layout_topology, static_layouts
from nitsum.policy.decisions import node_topology
from nitsum.policy.snapshot import ClusterSnapshot
from nitsum.policy.topology import AdaptivePolicy, change_worth, reconfig_ms
from nitsum.sim.cluster import ClusterConfig, ClusterSim, run_cluster
from nitsum.sim.experiments.common import Progress, md_table, table_target, write_csv
from nitsum.sim.experiments.tiers import fitting_static_policies, load_scale, workload

CAPTURE_S = (1.0, 5.0, 10.0, 15.0)  # 1 s: the boot choice (the first snapshot with arrivals)
DURATION_S = 30.0


class RecordingPolicy(AdaptivePolicy):
    """The adaptive policy, unchanged, keeping the first snapshot it decides on at or after each capture time."""

    def __init__(self, config, capture_ms: tuple[float, ...]) -> None:
        super().__init__(config)
        self.capture_ms = capture_ms
        self.snaps: dict[float, ClusterSnapshot] = {}

    def decide_topology(self, snap: ClusterSnapshot):
        for t in self.capture_ms:
            if t not in self.snaps and snap.now_ms >= t:
                self.snaps[t] = snap
        return super().decide_topology(snap)


def short(topology) -> str:
    """A topology as `static:` names it (`1p+1p+1d+...`)."""
    return layout_name(tuple((g.tp, g.role) for g in topology.groups))


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None when either side is constant."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return None if vx == 0 or vy == 0 else cov / (vx * vy) ** 0.5


@dataclass(frozen=True)
class Scored:
    policy: str
    score: float
    stream: float
    worth: float
    terms: dict[str, tuple[float, float, float]]  # tier -> (served, TTFT met, TPOT met) of the stream


def score_layouts(policy: AdaptivePolicy, snap: ClusterSnapshot, layouts: list[str]) -> list[Scored]:
    """Every `static:<layout>` scored on `snap` as the policy ranks candidates (node 0)."""
    cfg = policy.config
    node = snap.nodes[0]
    load = policy.node_load(snap, node)
    cost = policy.cost_for(node)
    cur = policy.evaluate_groups(cost, node_topology(node).groups, load, node)
    scale = policy.expected_remaining_ms(snap) / cfg.horizon_ms
    by_name = {f"static:{layout_name(lay)}": lay for lay in static_layouts(node.num_devices, node.allowed_tp_levels())}
    out = []
    for name in layouts:
        top = layout_topology(by_name[name])
        detail: list = []
        est = policy.evaluate_groups(cost, top.groups, load, node, detail)
        change = cfg.reconfig_lambda_per_ms * reconfig_ms(cost, top.groups, node, load)
        worth = change_worth(est.score, est.score - est.stream, change, cur.score, cur.score - cur.stream, scale)
        terms = {d.tier: (d.served, d.ttft_met, d.tpot_met) for d in detail}
        out.append(Scored(name, est.score, est.stream, worth, terms))
    return out


def simulated_terms(res, duration_ms: float) -> dict[str, tuple[float, float, float]]:
    """Per tier of the requests that arrived in the load: (served: got a first token, TTFT met of those, TPOT met
    of those in time), the simulator's counterparts of the stream's terms."""
    out = {}
    for tier in sorted({r.tier for r in res.records}):
        rs = [r for r in res.records if r.tier == tier and r.send_ms < duration_ms]
        served = [r for r in rs if r.first_token_ms is not None and r.error is None]
        timely = [r for r in served if r.ttft_met]
        good = [r for r in timely if r.slo_met]
        out[tier] = (
            len(served) / max(len(rs), 1),
            len(timely) / max(len(served), 1),
            len(good) / max(len(timely), 1),
        )
    return out


def study_point(
    config: ClusterConfig, rate: float, duration_s: float, capture_s: tuple[float, ...], seed: int, progress: Progress
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows: one per (capture time, layout); summary: one per capture time) at one stationary point."""
    reqs, _ = workload(rate, duration_s, seed)
    statics = fitting_static_policies(config)
    sim_wg, sim_terms = {}, {}
    for p in statics:
        res = run_cluster(p, config, reqs)
        sim_wg[p] = res.report.overall.weighted_goodput_rps
        sim_terms[p] = simulated_terms(res, duration_s * 1000.0)
        progress.step(f"{p} @ {rate:g}", res.sim_ms / 1000.0, res.events)
    rec = RecordingPolicy(config.policy_config(), tuple(t * 1000.0 for t in capture_s))
    ClusterSim(rec, config, reqs).run()
    progress.step(f"adaptive @ {rate:g}")
    rows, summary = [], []
    best_sim = max(statics, key=lambda p: sim_wg[p])
    for t_ms, snap in sorted(rec.snaps.items()):
        scored = score_layouts(rec, snap, statics)
        est_top = max(scored, key=lambda s: s.worth)
        for s in scored:
            row = {"rate_rps": rate, "at_s": t_ms / 1000.0, "current": short(node_topology(snap.nodes[0]))}
            row |= {"policy": s.policy, "sim_wg": sim_wg[s.policy], "est_score": s.score, "est_stream": s.stream}
            row |= {"est_worth": s.worth}
            for tier, (a, b, c) in sorted(s.terms.items()):
                sa, sb, sc = sim_terms[s.policy].get(tier, (0.0, 0.0, 0.0))
                row |= {f"{tier}_served": a, f"{tier}_ttft": b, f"{tier}_tpot": c}
                row |= {f"{tier}_sim_served": sa, f"{tier}_sim_ttft": sb, f"{tier}_sim_tpot": sc}
            rows.append(row)
        ws = [sim_wg[s.policy] for s in scored]
        rank_of = sorted(scored, key=lambda s: -s.worth)
        summary.append(
            {
                "rate_rps": rate,
                "at_s": t_ms / 1000.0,
                "current": short(node_topology(snap.nodes[0])),
                "rho_worth": spearman([s.worth for s in scored], ws),
                "rho_stream": spearman([s.stream for s in scored], ws),
                "est_top": est_top.policy,
                "est_top_sim_wg": sim_wg[est_top.policy],
                "sim_best": best_sim,
                "sim_best_wg": sim_wg[best_sim],
                "sim_best_est_rank": 1 + [s.policy for s in rank_of].index(best_sim),
            }
        )
    return rows, summary


def run(out: Path, quick: bool = False, seed: int = 0, device_table: Path | None = None) -> dict[str, Any]:
    model, device, table = table_target(device_table, ClusterConfig.model, ClusterConfig.device_kind)
    config = ClusterConfig(model=model, device_kind=device, device_table=table)
    scale = load_scale(config) if table is not None else 1.0
    if quick:
        rates, duration_s, capture_s = (8.0,), 8.0, (3.0, 6.0)
    elif table is not None:
        rates, duration_s, capture_s = (2.0, 8.0, 16.0, 20.0), DURATION_S, CAPTURE_S
    else:
        rates, duration_s, capture_s = (2.0, 12.0, 20.0), 60.0, CAPTURE_S
    rates = tuple(round(r * scale, 3) for r in rates)
    statics = fitting_static_policies(config)
    progress = Progress(len(rates) * (len(statics) + 1), "sim estimates")
    rows, summary = [], []
    for rate in rates:
        r, s = study_point(config, rate, duration_s, capture_s, seed, progress)
        rows += r
        summary += s
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "estimates.csv", rows)
    write_csv(out / "estimates_summary.csv", summary)
    md = [
        "# sim estimates",
        "",
        f"{model} on 8 x {device}; {len(statics)} static layouts; {duration_s:g} s per point, seed {seed}. The "
        "adaptive policy's estimate of every static layout on the snapshot it decided on at each capture time, "
        "against the simulated weighted goodput of that layout run statically (Spearman rho over the layouts).",
        "",
        md_table(summary, list(summary[0])) if summary else "(no snapshot captured)",
        "",
        progress.summary(),
        "",
    ]
    (out / "estimates.md").write_text("\n".join(md), encoding="utf-8")
    return {"rows": rows, "summary": summary, "speed": progress.summary()}
