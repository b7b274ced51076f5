"""`nitsum sim flows`: Nuska's large-scale setup (paper §6.3). P/D prefill cluster of 32-GPU MoE instances with
hybrid parallelism (Mixtral-8x22B TP4/EP8, DBRX TP2/EP16, Qwen3-Coder-like TP1/EP32), KV reuse from Mooncake
`hash_ids`, the instances' all-to-all as stage-2 flows on the same NICs as the KV traffic, A100 compute,
8 x 200 Gb/s NICs per server, 1:1 fat-tree, pruning on; RMLQ against FS, SJF, EDF and Karuna. Per point: TTFT
SLO attainment (SLO = 3x idle TTFT), non-overlapped collective completion time, non-negative earliness of P2D
transfers, and where the time and bytes went (compute, stage-1 / stage-2 stalls, uplink utilisation by stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nitsum.policy.flow_baselines import SCHEDULER_NAMES
from nitsum.sim.experiments.common import Progress, md_table, plot_lines, write_csv
from nitsum.sim.flowsetup import PAPER_SETUPS
from nitsum.sim.flowsim import FlowClusterConfig, FlowClusterSim
from nitsum.workloads import default_trace_path, is_excerpt, poisson, read_mooncake

BOTTLENECK_COLS = ("compute_busy", "stall_fetch", "stall_a2a", "uplink_util_stage1", "uplink_util_stage2",
                   "uplink_util_stage3", "link_util_max")


def run(out: Path, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    if quick:
        servers, rates, duration_s, setups = 16, (0.02, 0.1), 2.0, ("mixtral-tp4-ep8",)
    else:
        servers, rates, duration_s, setups = 64, (0.02, 0.05, 0.1, 0.2), 6.0, tuple(PAPER_SETUPS)
    trace_path = default_trace_path("mooncake-conv")
    trace = read_mooncake(trace_path)
    schedulers = tuple(SCHEDULER_NAMES)
    progress = Progress(len(setups) * len(rates) * len(schedulers), "sim flows")
    rows: list[dict[str, Any]] = []
    for setup_name in setups:
        setup = PAPER_SETUPS[setup_name]
        config = FlowClusterConfig(num_servers=servers, model=setup.model, tp=setup.tp, ep=setup.ep)
        for rate in rates:
            # Lengths and prefix ids drawn from the trace in its order (so KV reuse between requests survives).
            reqs = poisson(rate * servers * config.gpus_per_server, duration_s=duration_s, seed=seed, lengths=trace)
            for name in schedulers:
                res = FlowClusterSim(name, config, reqs).run()
                rep = res["report"].overall
                row = {"setup": setup_name, "scheduler": name, "servers": servers, "per_gpu_rate_rps": rate,
                       "requests": rep.requests, "ttft_slo_attainment": rep.slo_attainment,
                       "ttft_p50_ms": rep.ttft_ms.p50, "ttft_p99_ms": rep.ttft_ms.p99, "pruned": res["pruned"],
                       "cct_mean_ms": res["cct_ms"].mean, "cct_p99_ms": res["cct_ms"].p99,
                       "earliness_mean_ms": res["earliness_ms"].mean, "flows": res["flows"], "events": res["events"],
                       "wall_s": res["wall_s"]}
                row.update({k: res["bottleneck"][k] for k in BOTTLENECK_COLS})
                rows.append(row)
                progress.step(f"{setup_name} {name} @ {rate:g}/GPU", res["sim_ms"] / 1000.0, res["events"])
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "flows.csv", rows)

    def series(setup: str, col: str) -> dict[str, tuple[list, list]]:
        mine = [r for r in rows if r["setup"] == setup]
        return {s: ([r["per_gpu_rate_rps"] for r in mine if r["scheduler"] == s],
                    [r[col] for r in mine if r["scheduler"] == s]) for s in schedulers}

    panels = []
    for setup in setups:
        panels.append({"xlabel": f"{setup}: request rate per GPU (req/s)", "ylabel": "TTFT SLO attainment",
                       "series": series(setup, "ttft_slo_attainment")})
        panels.append({"xlabel": f"{setup}: request rate per GPU (req/s)", "ylabel": "non-overlapped CCT, mean (ms)",
                       "series": series(setup, "cct_mean_ms")})
    plot_lines(out / "flows.png", panels, f"P/D prefill cluster, {servers} servers x 8 A100, 8x200 Gb/s NICs")
    heads = {s: headline([r for r in rows if r["setup"] == s]) for s in setups}
    md = ["# sim flows", "",
          f"{servers} servers x 8 A100, 8 x 200 Gb/s NICs per server, 1:1 fat-tree; 32-GPU instances "
          f"({', '.join(setups)}); Mooncake lengths and prefix ids from `{trace_path.name}`"
          f"{' (committed excerpt)' if is_excerpt(trace_path) else ''}; Poisson arrivals, {duration_s:g} s per point; "
          "TTFT SLO = 3x idle TTFT; pruning on (RMLQ); seed {seed}.".replace("{seed}", str(seed)), ""]
    for s, h in heads.items():
        md.append(f"- {s}: RMLQ / best baseline TTFT SLO attainment at the highest rate {_f(h['ratio_at_max_rate'])}x, "
                  f"best over the sweep {_f(h['best_ratio'])}x at {h['at_rate']} req/s/GPU; RMLQ / best baseline "
                  f"mean CCT at the highest rate {_f(h['cct_ratio_at_max_rate'])}")
    md += ["", "Where the time and bytes go (fractions of instance time / of uplink capacity, 0 to the last batch end or transfer):",
           "", md_table(rows, ["setup", "scheduler", "per_gpu_rate_rps", *BOTTLENECK_COLS]), "",
           md_table(rows, ["setup", "scheduler", "per_gpu_rate_rps", "requests", "ttft_slo_attainment", "pruned",
                           "ttft_p50_ms", "ttft_p99_ms", "cct_mean_ms", "cct_p99_ms", "earliness_mean_ms"]),
           "", progress.summary(), ""]
    (out / "flows.md").write_text("\n".join(md), encoding="utf-8")
    return {"rows": rows, "headline": heads, "speed": progress.summary()}


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_rate: dict[float, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_rate.setdefault(r["per_gpu_rate_rps"], {})[r["scheduler"]] = r
    best, at, last, cct_last = None, None, None, None
    for rate in sorted(by_rate):
        d = by_rate[rate]
        base = max((v["ttft_slo_attainment"] or 0.0) for k, v in d.items() if k != "rmlq")
        ratio = (d["rmlq"]["ttft_slo_attainment"] or 0.0) / base if base > 0 and "rmlq" in d else None
        if ratio is not None and (best is None or ratio > best):
            best, at = ratio, rate
        last = ratio
        ccts = [v["cct_mean_ms"] for k, v in d.items() if k != "rmlq" and v["cct_mean_ms"] is not None]
        mine = d.get("rmlq", {}).get("cct_mean_ms")
        cct_last = mine / min(ccts) if ccts and mine is not None and min(ccts) > 0 else None
    return {"best_ratio": best, "at_rate": at, "ratio_at_max_rate": last, "cct_ratio_at_max_rate": cct_last}


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
