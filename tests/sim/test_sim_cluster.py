"""The cluster simulator: golden metrics for a fixed-seed scenario, same policy classes as the services,
cost-model sanity through the sim, the flow cluster, and the experiments' --quick modes."""

from __future__ import annotations

import csv

import pytest

from nitsum.policy.costmodel import cost_model
from nitsum.policy.flow_baselines import make_flow_scheduler
from nitsum.policy.registry import make_policy
from nitsum.sim.cluster import ClusterConfig, ClusterSim, run_cluster
from nitsum.sim.flowsim import FlowClusterConfig, FlowClusterSim
from nitsum.workloads import TraceRequest, assign_tiers, default_trace_path, poisson, read_azure, read_mooncake


def small_workload():
    lengths = read_azure(default_trace_path("azure-conv", prefer_excerpt=True))
    reqs = poisson(6.0, duration_s=10.0, seed=42, lengths=lengths)
    return assign_tiers(reqs, {"interactive": 0.3, "background": 0.7}, seed=42)


@pytest.mark.parametrize(
    "policy, slo_met, interactive_met, events",
    [("static-tp:8", 63, 18, 1434), ("disagg", 45, 0, 1727)],
)
def test_golden_metrics_small_fixed_seed_scenario(policy, slo_met, interactive_met, events):
    """Golden values: a change here means the simulator, the cost model or the policy changed behaviour."""
    res = run_cluster(policy, ClusterConfig(), small_workload())
    overall = res.report.overall
    assert overall.requests == 64
    assert overall.slo_met == slo_met
    assert res.report.tiers["interactive"].slo_met == interactive_met
    assert res.events == events


def test_runs_are_deterministic():
    a = run_cluster("static-tp:2", ClusterConfig(), small_workload())
    b = run_cluster("static-tp:2", ClusterConfig(), small_workload())
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]


def test_simulator_uses_the_very_same_policy_classes_as_the_services():
    for spec in ("adaptive", "static-tp:8", "disagg"):
        sim = ClusterSim(spec, ClusterConfig(), [])
        assert type(sim.policy) is type(make_policy(spec)), spec
    flows = FlowClusterSim("rmlq", FlowClusterConfig(num_servers=8), [])
    assert type(flows.sched) is type(make_flow_scheduler("rmlq"))
    assert type(flows.sched).__module__ == "nitsum.policy.flows"


def test_static_tp1_cannot_hold_llama70b_on_h100_and_says_so():
    res = run_cluster("static-tp:1", ClusterConfig(), small_workload()[:5])
    assert res.report.overall.errors == {"http_503": 5}


def test_decode_step_llama70b_tp8_h100_between_memory_floor_and_twice_it():
    cost = cost_model("llama-3-70b", "h100")
    floor = cost.memory_floor_ms(8, context_tokens=32 * 1024)
    step = cost.decode_step_ms(8, 32, 32 * 1024)
    assert floor < step < 2 * floor


def test_single_interactive_request_ttft_is_its_prefill_time():
    """One 512-token request alone on TP8: TTFT = one hybrid step of 512 tokens (chunk = 512)."""
    from nitsum.workloads import TraceRequest

    res = run_cluster("static-tp:8", ClusterConfig(), [TraceRequest(0.0, 512, 4, tier="interactive")])
    rec = res.records[0]
    expected = cost_model("llama-3-70b", "h100").step_time_ms(8, 1, 512, 512)
    assert rec.ttft_ms == pytest.approx(expected)
    assert rec.finish_ms is not None and rec.output_tokens == 4


def test_flow_cluster_schedulers_all_run_and_idle_load_meets_slo():
    trace = read_mooncake(default_trace_path("mooncake-conv", prefer_excerpt=True))
    reqs = poisson(0.5, duration_s=8.0, seed=3, lengths=trace)  # two 32-GPU A100 instances, far from busy
    for name in ("fs", "sjf", "edf", "karuna", "rmlq"):
        out = FlowClusterSim(name, FlowClusterConfig(num_servers=16), reqs).run()
        rep = out["report"].overall
        assert rep.requests == len(reqs)
        assert rep.slo_attainment == 1.0, name  # nearly idle: everyone within 3x idle TTFT
        assert out["cct_ms"].count > 0


@pytest.mark.parametrize("name", ["reconfig", "flows"])  # tiers: its own test below (one quick run)
def test_quick_experiments_write_csv_png_md(name, tmp_path):
    from nitsum.sim.cli import main

    assert main([name, "--quick", "--out", str(tmp_path), "--seed", "1"]) == 0
    rows = list(csv.DictReader((tmp_path / f"{name}.csv").open()))
    assert rows
    assert (tmp_path / f"{name}.md").read_text().startswith(f"# sim {name}")
    assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_cli_rejects_unknown_experiment(capsys):
    from nitsum.sim.cli import main

    with pytest.raises(SystemExit):
        main(["nope"])
    assert "invalid choice" in capsys.readouterr().err


def test_tiers_compares_every_fitting_static_layout_and_the_best_static_column_is_their_max(tmp_path):
    from nitsum.sim.experiments import tiers

    result = tiers.run(tmp_path, quick=True)
    for suffix in (".csv", "_phased.csv", ".md", ".png"):
        assert (tmp_path / f"tiers{suffix}").stat().st_size > 100
    assert (tmp_path / "tiers.md").read_text().startswith("# sim tiers")
    rows = result["rows"]
    statics = sorted({r["policy"] for r in rows if r["policy"].startswith("static:")})
    # Llama-3-70B on 80 GB H100s: TP1 cannot hold the weights; every layout of TP2/TP4/TP8 groups is there.
    assert (
        "static:8" in statics and "static:4+4" in statics and "static:4+2+2" in statics and "static:2+2+2+2" in statics
    )
    assert "static:4p+4d" in statics and "static:4p+2d+2d" in statics and "static:2p+2p+4d" in statics
    assert not any("1" in s.split(":")[1].replace("+", " ").split() for s in statics)
    for rate in {r["rate_rps"] for r in rows}:
        at = [r for r in rows if r["rate_rps"] == rate and r["nodes"] == 1]
        best = max((r for r in at if r["policy"].startswith("static:")), key=lambda r: r["weighted_goodput_rps"])
        for r in at:
            assert r["best_static_weighted_goodput_rps"] == best["weighted_goodput_rps"]
            assert r["best_static"] == best["policy"]
    ph = result["phased"]
    statics_ph = [r for r in ph["rows"] if r["policy"].startswith("static:")]
    assert ph["best_static"]["weighted_goodput_rps"] == max(r["weighted_goodput_rps"] for r in statics_ph)
    # The oracle takes the best static layout of each phase: never below the best single static layout.
    assert ph["oracle"] >= ph["best_static"]["weighted_goodput_rps"] - 1e-9
    for name, (_policy, wg) in ph["oracle_parts"].items():
        assert wg == max(r[f"{name}_wg"] for r in statics_ph)


def test_tiers_reports_the_phased_load_on_several_seeds_and_their_mean(tmp_path, capsys):
    from nitsum.sim.cli import main
    from nitsum.sim.experiments import tiers

    result = tiers.run(tmp_path, quick=True, seed=3, phased_seeds=2)
    seeds = result["phased_seeds"]
    assert [s for s, _ in seeds["runs"]] == [3, 4] and [r["seed"] for r in seeds["rows"]] == [3, 4]
    assert seeds["runs"][0][1] is result["phased"]  # the main phased table is the first seed's
    for (_, ph), row in zip(seeds["runs"], seeds["rows"]):
        statics = [r for r in ph["rows"] if r["policy"].startswith("static:")]
        best = max(statics, key=lambda r: r["weighted_goodput_rps"])
        adaptive = next(r for r in ph["rows"] if r["policy"] == "adaptive")
        assert row["best_static"] == best["policy"] and row["best_static_wg"] == best["weighted_goodput_rps"]
        assert row["adaptive_vs_best_static"] == pytest.approx(
            adaptive["weighted_goodput_rps"] / best["weighted_goodput_rps"]
        )
    ratios = [r["adaptive_vs_best_static"] for r in seeds["rows"]]
    assert seeds["mean"]["adaptive_vs_best_static"] == pytest.approx(sum(ratios) / 2)
    assert seeds["mean"]["min_adaptive_vs_best_static"] == min(ratios)
    assert "## Phased over 2 seeds (3-4)" in (tmp_path / "tiers.md").read_text()
    assert (tmp_path / "tiers_phased_seeds.csv").read_text().count("\n") == 3  # header and two seeds

    # Bad values are refused before anything runs.
    assert main(["tiers", "--quick", "--phased-seeds", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--phased-seeds must be >= 1" in capsys.readouterr().err
    assert main(["flows", "--quick", "--phased-seeds", "2", "--out", str(tmp_path / "y")]) == 2
    assert "option of `sim tiers` only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_tiers_reports_the_stationary_sweep_on_several_seeds_with_the_layout_best_for_the_load(tmp_path, capsys):
    from nitsum.sim.cli import main
    from nitsum.sim.experiments import tiers

    result = tiers.run(tmp_path, quick=True, seed=5, stationary_seeds=2)
    st = result["stationary_seeds"]
    assert [s for s, _ in st["runs"]] == [5, 6] and st["runs"][0][1] is result["rows"]
    rates = sorted({r["rate_rps"] for r in result["rows"] if r["nodes"] == 1})
    assert sorted(r["rate_rps"] for r in st["summary"]) == rates
    assert len(st["rows"]) == 2 * len(rates)
    for row in st["summary"]:
        runs = [[r for r in rows if r["rate_rps"] == row["rate_rps"] and r["nodes"] == 1] for _, rows in st["runs"]]
        mean = {}
        for rs in runs:
            for r in rs:
                mean[r["policy"]] = mean.get(r["policy"], 0.0) + r["weighted_goodput_rps"] / 2
        statics = {p: m for p, m in mean.items() if p.startswith("static:")}
        best = max(statics, key=lambda p: statics[p])
        assert row["best_for_the_load"] == best and row["best_for_the_load_mean_wg"] == pytest.approx(statics[best])
        assert row["adaptive_mean_wg"] == pytest.approx(mean["adaptive"])
        if statics[best]:
            assert row["adaptive_vs_best_for_the_load"] == pytest.approx(mean["adaptive"] / statics[best])
        boot = row["boot_then_best_mean_wg"]
        assert boot is not None and boot >= 0.0
        if statics[best]:
            assert row["boot_then_best_vs_best_for_the_load"] == pytest.approx(boot / statics[best])
        # Each seed's best in hindsight is at least the best-for-the-load layout's figure on that seed.
        for rs in runs:
            hindsight = max(r["weighted_goodput_rps"] for r in rs if r["policy"].startswith("static:"))
            assert hindsight >= next(r["weighted_goodput_rps"] for r in rs if r["policy"] == best)
            assert rs[0]["best_static"] in row["best_in_hindsight"].split()
    assert "## Stationary over 2 seeds (5-6)" in (tmp_path / "tiers.md").read_text()
    assert "boot_then_best_vs_best_for_the_load" in (tmp_path / "tiers.md").read_text()
    assert (tmp_path / "tiers_stationary_seeds.csv").read_text().count("\n") == 1 + 2 * len(rates)

    assert main(["tiers", "--quick", "--stationary-seeds", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--stationary-seeds must be >= 1" in capsys.readouterr().err
    assert main(["mixes", "--quick", "--stationary-seeds", "2", "--out", str(tmp_path / "y")]) == 2
    assert "option of `sim tiers` only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_boot_then_static_boots_as_adaptive_and_moves_at_its_first_decision():
    from nitsum.sim.experiments.stationary_seeds import BootThenStatic

    # No arrival in the first two seconds: the epochs at 0, 1 and 2 s carry no measured arrivals, so it waits on
    # adaptive's boot layout (TP8 on the data-sheet table) and moves at 3 s, once, for good.
    work = [TraceRequest(2500.0 + 50.0 * i, 1000, 20, tier="background") for i in range(40)]
    config = ClusterConfig()
    res = run_cluster(BootThenStatic("4+4", config.policy_config()), config, work)
    assert [(t, top) for t, _, top in res.topologies] == [
        (0.0, "[0-7 TP8 hybrid]"),
        (3000.0, "[0-3 TP4 hybrid][4-7 TP4 hybrid]"),
    ]
    assert all(r.finish_ms is not None for r in res.records)
