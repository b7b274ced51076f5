"""`nitsum sim reconfig`: goodput of the adaptive policy against the reconfiguration cost (0 to 1,000 ms,
a fixed pause replacing the cost model's estimate) and against the policy epoch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from nitsum.sim.cluster import ClusterConfig, run_cluster
from nitsum.sim.experiments.common import Progress, md_table, plot_lines, table_target, write_csv
from nitsum.sim.experiments.tiers import workload


def run(out: Path, quick: bool = False, seed: int = 0, device_table: Path | None = None) -> dict[str, Any]:
    if quick:
        costs, epochs, rate, duration_s = (0.0, 1000.0), (1000.0,), 8.0, 10.0
    else:
        costs, epochs, rate, duration_s = (
            (0.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0),
            (250.0, 500.0, 1000.0, 2000.0, 4000.0),
            8.0,
            60.0,
        )
    reqs, _ = workload(rate, duration_s, seed)
    progress = Progress(len(costs) + len(epochs) + 1, "sim reconfig")
    model, device, rows = table_target(device_table, ClusterConfig.model, ClusterConfig.device_kind)
    base = ClusterConfig(model=model, device_kind=device, device_table=rows)
    rows: list[dict[str, Any]] = []

    def one(kind: str, value: float | None, config: ClusterConfig, policy: str = "adaptive") -> None:
        res = run_cluster(policy, config, reqs)
        rep = res.report
        rows.append(
            {
                "sweep": kind,
                "value": value,
                "policy": policy,
                "rate_rps": rate,
                "goodput_rps": rep.overall.goodput_rps,
                "weighted_goodput_rps": rep.overall.weighted_goodput_rps,
                "slo_attainment": rep.overall.slo_attainment,
                "reconfigurations": res.reconfigurations,
                "pause_ms_total": res.reconfig_pause_ms,
            }
        )
        progress.step(f"{kind}={value}", res.sim_ms / 1000.0, res.events)

    one("baseline", None, base, "static-tp:8")
    for c in costs:
        one("reconfig_cost_ms", c, replace(base, reconfig_cost_ms=c))
    for e in epochs:
        one("epoch_ms", e, replace(base, epoch_ms=e))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "reconfig.csv", rows)
    cost_rows = [r for r in rows if r["sweep"] == "reconfig_cost_ms"]
    epoch_rows = [r for r in rows if r["sweep"] == "epoch_ms"]
    plot_lines(
        out / "reconfig.png",
        [
            {
                "xlabel": "reconfiguration cost (ms)",
                "ylabel": "goodput (req/s)",
                "series": {"adaptive": ([r["value"] for r in cost_rows], [r["goodput_rps"] for r in cost_rows])},
            },
            {
                "xlabel": "policy epoch (ms)",
                "ylabel": "goodput (req/s)",
                "series": {"adaptive": ([r["value"] for r in epoch_rows], [r["goodput_rps"] for r in epoch_rows])},
            },
        ],
        f"adaptive policy sensitivity at {rate:g} req/s",
    )
    md = [
        "# sim reconfig",
        "",
        f"Workload as `sim tiers` at {rate:g} req/s for {duration_s:g} s, seed {seed}. "
        "Baseline row: static-tp:8 on the same workload.",
        "",
        md_table(
            rows,
            [
                "sweep",
                "value",
                "policy",
                "goodput_rps",
                "weighted_goodput_rps",
                "slo_attainment",
                "reconfigurations",
                "pause_ms_total",
            ],
        ),
        "",
        progress.summary(),
        "",
    ]
    (out / "reconfig.md").write_text("\n".join(md), encoding="utf-8")
    return {"rows": rows, "speed": progress.summary()}
