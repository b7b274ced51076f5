"""A shifting load, fixed seed: the adaptive policy changes the layout once per phase, in the direction the
phase calls for (batch window: down to more, smaller groups; interactive surge: up to a consolidated group),
and back; the static layouts confirm those directions are the right ones on this scenario."""

from __future__ import annotations

import pytest

from nitsum.sim.cluster import ClusterConfig, run_cluster
from nitsum.sim.experiments.tiers import layout_per_phase, phase_goodput, phased_workload
from nitsum.workloads import Phase, phase_bounds
from nitsum.workloads.paths import traces_dir

# The scenario draws its lengths from the full Azure and ServeGen traces; the committed excerpts give another
# length mix, on which these phase directions do not hold (measured: the surge then keeps TP4x2). So without the
# real traces the scenario is not the one this test states, and it is skipped rather than re-tuned.
pytestmark = pytest.mark.skipif(
    traces_dir() is None, reason="needs the real traces (shared/traces or NITSUM_TRACES_DIR)"
)

# Background only at 20 req/s (ServeGen lengths), then interactive only at 6 req/s (Azure code lengths), then
# the batch window again. Llama-3-70B on 8 x H100 (data-sheet table).
PHASES = (Phase("batch", 40.0, 20.0, 0.0), Phase("surge", 40.0, 6.0, 1.0), Phase("batch2", 40.0, 20.0, 0.0))


@pytest.fixture(scope="module")
def runs():
    reqs, _ = phased_workload(PHASES, seed=0)
    return {p: run_cluster(p, ClusterConfig(), reqs) for p in ("adaptive", "static:8", "static:4+4")}


def test_the_phases_call_for_different_layouts(runs):
    tp8, tp4 = phase_goodput(runs["static:8"], PHASES), phase_goodput(runs["static:4+4"], PHASES)
    assert tp4["batch"] > tp8["batch"] and tp4["batch2"] > tp8["batch2"]  # throughput: two TP4 groups
    assert tp8["surge"] > tp4["surge"]  # long interactive prompts within 200 ms: TP8


def test_adaptive_moves_once_per_phase_in_the_expected_direction_and_back(runs):
    res = runs["adaptive"]
    per_phase = layout_per_phase(res, PHASES)
    # (changes inside the phase, device-weighted mean TP at its start, at its end)
    assert per_phase["batch"][0] == 1 and per_phase["batch"][2] < per_phase["batch"][1]  # down
    assert per_phase["surge"][0] == 1 and per_phase["surge"][2] > per_phase["surge"][1]  # up
    assert per_phase["batch2"][0] == 1 and per_phase["batch2"][2] < per_phase["batch2"][1]  # and back down
    assert res.reconfigurations == 3
    # Each change comes after its phase began (the policy follows the load, it does not foresee it).
    bounds = phase_bounds(PHASES)
    changes = [t for t, node, _ in res.layouts if t > 0]
    assert [any(start < t < end for t in changes) for _, start, end in bounds] == [True, True, True]


def test_adaptive_is_at_least_the_best_static_layout_of_each_phase_within_a_tenth(runs):
    ad = phase_goodput(runs["adaptive"], PHASES)
    for name in ad:
        best = max(phase_goodput(runs[p], PHASES)[name] for p in ("static:8", "static:4+4"))
        assert ad[name] >= 0.9 * best, (name, ad[name], best)
