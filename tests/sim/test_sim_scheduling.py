"""Hybrid-group scheduling in the cluster simulator: SLO-aware chunks and EDF prefill order.

Both would have caught the modelling that made every topology look alike in `sim tiers`: a fixed 512-token
chunk makes a Llama-3-70B TP8 step 26 ms (> the 25 ms interactive TPOT), and a FIFO prefill list kept an
interactive arrival behind a long background prompt's remaining chunks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from nitsum.policy.costmodel import DeviceSpec
from nitsum.sim.cluster import ClusterConfig, run_cluster
from nitsum.workloads import TraceRequest


def _tpot_ms(rec) -> float:
    return (rec.finish_ms - rec.first_token_ms) / (rec.output_tokens - 1)


def test_interactive_decode_beside_a_long_prefill_meets_tpot_only_with_slo_aware_chunks():
    # An interactive request decodes 40 tokens while a 30k-token background prompt (~60 chunks) is prefilled.
    work = [TraceRequest(0.0, 256, 40, tier="interactive"), TraceRequest(5.0, 30_000, 4, tier="background")]
    aware = run_cluster("static-tp:8", ClusterConfig(), work).records[0]
    fixed = run_cluster("static-tp:8", replace(ClusterConfig(), tpot_aware_chunks=False), work).records[0]
    assert _tpot_ms(aware) <= 25.0 < _tpot_ms(fixed)


def test_interactive_arrival_overtakes_a_background_prefill_in_progress():
    # A 16k-token background prompt takes ~32 hybrid steps; the interactive one arrives after the first.
    work = [TraceRequest(0.0, 16_000, 4, tier="background"), TraceRequest(30.0, 512, 4, tier="interactive")]
    res = run_cluster("static-tp:8", ClusterConfig(), work)
    bg, inter = res.records
    assert inter.first_token_ms - inter.send_ms <= 200.0  # its TTFT target
    assert inter.first_token_ms < bg.first_token_ms  # it did not wait for the rest of the long prompt
    assert bg.finish_ms is not None  # and the background prompt resumed and finished


def test_epoch_snapshots_carry_measured_arrival_rates():
    from nitsum.sim.cluster import ClusterSim

    work = [TraceRequest(100.0 * i, 1000, 10, tier="background" if i % 2 else "interactive") for i in range(50)]

    def measured(**kw):
        sim = ClusterSim("static-tp:8", ClusterConfig(arrival_window_ms=1000.0, **kw), work)
        seen = []
        orig = sim.policy.decide_topology

        def spy(snap):
            seen.append((snap.now_ms, {a.tier: a.rate_per_s for a in snap.arrivals}))
            return orig(snap)

        sim.policy.decide_topology = spy
        sim.run()
        return dict(seen)

    rates = measured(arrival_regime_ms=0.0)
    # At t = 3 s the window [2 s, 3 s] holds 11 arrivals at 100 ms spacing: 6 interactive, 5 background.
    assert rates[3000.0] == {"interactive": 6.0, "background": 5.0}
    assert rates[0.0] == {}  # nothing measured before the first arrival
    # Measured over the steady stretch (no shift since 0): [0 s, 3 s] holds 16 interactive and 15 background.
    rates = measured()
    assert rates[3000.0] == {"interactive": 16 / 3, "background": 5.0}
    assert rates[0.0] == {}


@pytest.mark.parametrize("in_budget, ttft_ms", [(True, 3.5), (False, 2.5)])
def test_engine_budget_pays_for_decode_tokens_too(in_budget, ttft_ms):
    """nitsum's engine scheduler: running decodes take their token out of the step budget first. Flat 1 ms
    steps; A decodes from t=1; B (16 tokens) arrives at 1.5 and prefills from t=2 in chunks of 8 - 1 (7, 7, 2:
    first token at 5) or of 8 (8, 8: at 4)."""
    flat = DeviceSpec(
        "flat",
        peak_flops=1e30,
        mem_bandwidth_bytes_per_s=1e30,
        link_bandwidth_bytes_per_s=1.0,
        memory_bytes=1e12,
        step_overhead_ms=1.0,
    )
    config = ClusterConfig(
        model="tiny",
        device_kind=flat,
        num_nodes=1,
        devices_per_node=1,
        min_tp=1,
        max_tp=1,
        chunk_tokens=8,
        tpot_aware_chunks=False,
        decode_tokens_in_budget=in_budget,
    )
    w = [
        TraceRequest(arrival_ms=0.0, prompt_tokens=4, output_tokens=50),
        TraceRequest(arrival_ms=1.5, prompt_tokens=16, output_tokens=2),
    ]
    a, b = run_cluster("static-tp:1", config, w).records
    assert a.ttft_ms == pytest.approx(1.0)
    assert b.ttft_ms == pytest.approx(ttft_ms)
