"""`nitsum bench policy --live` (phased): its rules (rates, caps, SLO targets) and its scoring (per phase, oracle),
without a mesh. The live run itself is a benchmark (docs/BENCHMARKS.md), not a test."""

from __future__ import annotations

import argparse

import pytest

from nitsum.metrics import RequestRecord
from nitsum.policy.baselines import layout_topology, static_layouts
from nitsum.policy.tiers import DEFAULT_TIERS
from nitsum_load.bench_policy_phased import (
    STATIC_LIVE,
    _costs,
    build,
    derive_targets,
    fixed_layout,
    layout_of,
    oracle,
    per_phase,
    reported_layout,
)


def _args(**kw):
    base = {
        "device_table": None,
        "phase_s": 5.0,
        "seed": 0,
        "max_prompt_tokens": 1024,
        "max_output_tokens": 64,
        "rate_scale": 1.0,
    }
    return argparse.Namespace(**{**base, **kw})


def test_targets_scale_the_tier_table_by_the_profiled_step_times():
    live, ref = _costs(None)
    targets = derive_targets(live, ref, 1024)
    inter, back = targets["interactive"], targets["background"]
    # one factor per target kind, the same for every tier: the tier table's ratios are kept
    assert inter[0] / DEFAULT_TIERS["interactive"].ttft_ms == pytest.approx(
        back[0] / DEFAULT_TIERS["background"].ttft_ms
    )
    assert inter[1] / DEFAULT_TIERS["interactive"].tpot_ms == pytest.approx(
        back[1] / DEFAULT_TIERS["background"].tpot_ms
    )
    assert inter[0] > DEFAULT_TIERS["interactive"].ttft_ms  # a CPU is slower than the simulated H100 node
    assert (inter[2], back[2]) == (10.0, 1.0)


def test_the_workload_keeps_the_phases_caps_and_targets():
    specs, bounds, rules = build(_args())
    assert [b[0] for b in bounds] == ["surge", "batch", "mixed", "surge2"]
    assert bounds[-1][2] == 20_000.0
    assert all(s.prompt_tokens <= 1024 and s.output_tokens <= 64 for s in specs)
    for s in specs:
        t = rules["targets"][s.tier]
        assert (s.ttft_slo_ms, s.tpot_slo_ms, s.weight) == (t["ttft_ms"], t["tpot_ms"], t["weight"])
    surge = [s for s in specs if s.arrival_ms < 5000]
    batch = [s for s in specs if 5000 <= s.arrival_ms < 10_000]
    share = lambda xs: sum(s.tier == "interactive" for s in xs) / len(xs)  # noqa: E731
    assert share(surge) > 0.7 > 0.3 > share(batch)


def test_rate_scale_multiplies_every_phases_rate_and_is_recorded():
    plain_specs, _, plain = build(_args())
    specs, _, doubled = build(_args(rate_scale=2.0))
    assert doubled["rate_scale"] == 2.0 and plain["rate_scale"] == 1.0
    for a, b in zip(plain["phases"], doubled["phases"]):
        assert b["rate_per_s"] == pytest.approx(2.0 * a["rate_per_s"])
    assert len(specs) > 1.5 * len(plain_specs)  # Poisson arrivals at twice the rate


def test_a_rate_scale_that_is_not_positive_is_refused(capsys):
    from nitsum_load.bench_policy_phased import main

    with pytest.raises(SystemExit) as info:
        main(["--rate-scale", "0"])
    assert info.value.code == 2 and "--rate-scale must be > 0" in capsys.readouterr().err


def _rec(rid, tier, send, ok):
    w = DEFAULT_TIERS[tier].weight
    return RequestRecord(
        request_id=rid,
        tier=tier,
        ttft_slo_ms=1000.0,
        tpot_slo_ms=1000.0,
        weight=w,
        send_ms=send,
        first_token_ms=send + (10.0 if ok else 5000.0),
        finish_ms=send + (20.0 if ok else 5010.0),
        output_tokens=2,
        prompt_tokens=4,
    )


def test_per_phase_scoring_and_the_oracle_take_each_phase_best_static_layout():
    bounds = [("a", 0.0, 1000.0), ("b", 1000.0, 2000.0), ("c", 2000.0, 3000.0)]
    runs = {
        "static-tp:1": [_rec("1", "interactive", 10.0, True), _rec("2", "background", 1010.0, False)],
        "static-tp:2": [_rec("1", "interactive", 10.0, False), _rec("2", "background", 1010.0, True)],
        "disagg": [_rec("1", "interactive", 10.0, False), _rec("3", "interactive", 2010.0, True)],
        # adaptive is no static layout: its best phases never count for the oracle
        "adaptive": [_rec(str(i), "interactive", 1000.0 * i + 10.0, True) for i in range(3)],
    }
    results = {p: {"phases": per_phase(r, bounds)} for p, r in runs.items()}
    assert results["static-tp:1"]["phases"]["a"]["weighted_goodput_rps"] == pytest.approx(10.0)
    o = oracle(results, bounds)
    assert o["per_phase"] == {"a": "static-tp:1", "b": "static-tp:2", "c": "disagg"}
    assert o["weighted_goodput_rps"] == pytest.approx((10.0 + 1.0 + 10.0) / 3)


def test_the_static_policies_are_every_static_layout_of_a_2_device_node_world():
    every = {str(layout_topology(groups)) for groups in static_layouts(2, (1, 2))}
    assert {fixed_layout(p) for p in STATIC_LIVE} == every
    assert len(every) == len(STATIC_LIVE) == 3
    assert fixed_layout("disagg") == "[0 TP1 prefill][1 TP1 decode]"
    # static-hybrid's two lanes are both TP1 hybrid on 2 devices: static-tp:1's layout, so it is left out
    assert fixed_layout("static-hybrid") == fixed_layout("static-tp:1") == "[0 TP1 hybrid][1 TP1 hybrid]"
    assert fixed_layout("adaptive") is None


def _worker(device, tp, role, group, leader=True, state="ready"):
    return {"device_index": device, "tp": tp, "role": role, "group_id": group, "leader": leader, "state": state}


def test_the_reported_layout_has_roles_and_waits_for_every_worker():
    pd = [_worker(1, 1, "decode", "g1"), _worker(0, 1, "prefill", "g0")]
    assert reported_layout({"workers": pd}) == "[0 TP1 prefill][1 TP1 decode]"
    tp2 = [_worker(0, 2, "hybrid", "g0"), _worker(1, 2, "hybrid", "g0", leader=False)]
    assert reported_layout({"workers": tp2}) == "[0-1 TP2 hybrid]"
    # not settled: a worker not ready, a member still in its old group, no workers yet
    assert reported_layout({"workers": [pd[0], {**pd[1], "state": "starting"}]}) == ""
    assert reported_layout({"workers": [tp2[0], _worker(1, 1, "hybrid", "g1", leader=False)]}) == ""
    assert reported_layout({"workers": []}) == ""


def test_layout_names():
    status = {
        "groups": [
            {"group_id": "n-g1-tp1", "tp": 1, "role": "hybrid"},
            {"group_id": "n-g0-tp1", "tp": 1, "role": "prefill"},
        ]
    }
    assert layout_of(status) == "TP1p+TP1"
