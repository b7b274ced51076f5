"""A shifting load, fixed seed, on the committed trace excerpts (so CI runs it with or without shared/traces):
the adaptive policy changes the layout once per phase, in the direction the phase calls for (batch window: down
to more, smaller groups; interactive surge: up to a consolidated group), and back.

The scenario's directions hold by construction, from the cost model (Llama-3-70B on 8 x H100, data-sheet
table), not from a run:
- batch windows: background only, Azure 2023 code lengths (long prompts: prefill-bound), at the midpoint of the
  rates TP8 and two TP4 groups can prefill. TP8 is overloaded (~13 %), TP4x2 is not; each window lasts 90 s, long
  enough for TP8's growing backlog to pass the 10 s background TTFT target (at 60 s it would not).
- surge: interactive only, 2 req/s, the excerpt's prompts that TP8 prefills within the 200 ms TTFT target and
  a TP4 group does not: TP4x2 can meet none of them.
"""

from __future__ import annotations

import pytest

from nitsum.sim.cluster import ClusterConfig, run_cluster
from nitsum.sim.experiments.tiers import layout_per_phase, phase_goodput
from nitsum.workloads import Phase, default_trace_path, phase_bounds, phased, read_azure

TTFT_MS = 200.0  # the interactive tier's target (policy.tiers.INTERACTIVE)


def scenario():
    config = ClusterConfig()
    cost = config.cost_model()
    code = read_azure(default_trace_path("azure-code", prefer_excerpt=True))

    def prefill_ms(tp: int, prompt: int) -> float:  # a hybrid group with nothing else to do: full chunks
        return cost.prefill_time_ms(tp, prompt, chunk_tokens=config.chunk_tokens)

    def capacity_per_s(tp: int) -> float:
        mean_ms = sum(prefill_ms(tp, r.prompt_tokens) for r in code) / len(code)
        return config.devices_per_node // tp * 1000.0 / mean_ms

    tp8, tp4x2 = capacity_per_s(8), capacity_per_s(4)
    rate = (tp8 + tp4x2) / 2.0
    long_prompts = [r for r in code if prefill_ms(8, r.prompt_tokens) <= TTFT_MS < prefill_ms(4, r.prompt_tokens)]
    phases = (Phase("batch", 90.0, rate, 0.0), Phase("surge", 40.0, 2.0, 1.0), Phase("batch2", 90.0, rate, 0.0))
    return config, phased(phases, long_prompts, code, seed=0), phases, (tp8, tp4x2, rate, len(long_prompts))


@pytest.fixture(scope="module")
def runs():
    config, reqs, phases, construction = scenario()
    results = {p: run_cluster(p, config, reqs) for p in ("adaptive", "static:8", "static:4+4")}
    return results, phases, construction


def test_the_scenario_is_what_it_says(runs):
    _, _, (tp8, tp4x2, rate, n_long) = runs
    assert tp8 < rate < tp4x2  # the batch window overloads TP8 only
    # ... by enough that TP8's backlog passes the 10 s background target within the 90 s window
    assert (rate - tp8) * 90.0 / tp8 > 10.0
    assert n_long >= 20  # the surge draws from enough distinct prompts


def test_the_phases_call_for_different_layouts(runs):
    results, phases, _ = runs
    tp8, tp4 = phase_goodput(results["static:8"], phases), phase_goodput(results["static:4+4"], phases)
    assert tp4["batch"] > tp8["batch"] and tp4["batch2"] >= tp8["batch2"]  # throughput: two TP4 groups
    assert tp8["surge"] > 0.0 == tp4["surge"]  # long interactive prompts within 200 ms: only TP8


def test_adaptive_moves_once_per_phase_in_the_expected_direction_and_back(runs):
    results, phases, _ = runs
    res = results["adaptive"]
    per_phase = layout_per_phase(res, phases)
    # (changes inside the phase, device-weighted mean TP at its start, at its end)
    assert per_phase["batch"][0] == 1 and per_phase["batch"][2] < per_phase["batch"][1]  # down
    assert per_phase["surge"][0] == 1 and per_phase["surge"][2] > per_phase["surge"][1]  # up
    assert per_phase["batch2"][0] == 1 and per_phase["batch2"][2] < per_phase["batch2"][1]  # and back down
    assert res.reconfigurations == 3
    # Each change comes after its phase began (the policy follows the load, it does not foresee it).
    bounds = phase_bounds(phases)
    changes = [t for t, node, _ in res.layouts if t > 0]
    assert [any(start < t < end for t in changes) for _, start, end in bounds] == [True, True, True]


def test_adaptive_is_at_least_the_best_static_layout_of_each_phase_within_a_tenth(runs):
    results, phases, _ = runs
    ad = phase_goodput(results["adaptive"], phases)
    for name in ad:
        best = max(phase_goodput(results[p], phases)[name] for p in ("static:8", "static:4+4"))
        assert ad[name] >= 0.9 * best, (name, ad[name], best)
