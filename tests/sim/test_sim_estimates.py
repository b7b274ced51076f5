"""`nitsum sim estimates` (issue 17, round nine): the adaptive estimator's scores of every static layout on the
snapshots the policy decided on, beside each layout's simulated goodput."""

from __future__ import annotations

from nitsum.policy.baselines import layout_name, layout_topology, static_layouts
from nitsum.policy.decisions import node_topology
from nitsum.policy.topology import reconfig_ms
from nitsum.sim.cluster import ClusterConfig, ClusterSim
from nitsum.sim.experiments.common import Progress
from nitsum.sim.experiments.estimates import RecordingPolicy, score_layouts, short, spearman, study_point
from nitsum.sim.experiments.tiers import fitting_static_policies, workload


def test_spearman_ranks_with_ties_and_refuses_a_constant_side():
    assert spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]) == 1.0
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0
    # ties take their average rank: ranks (0.5, 0.5, 2) against (0, 1, 2)
    assert abs(spearman([5.0, 5.0, 7.0], [1.0, 2.0, 3.0]) - 0.8660254) < 1e-6
    assert spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None


def test_the_current_layout_is_worth_nothing_and_the_stream_terms_add_up():
    config = ClusterConfig(device_kind="cpu", model="tiny")
    reqs, _ = workload(8.0, 8.0, seed=0)
    rec = RecordingPolicy(config.policy_config(), (4000.0,))
    ClusterSim(rec, config, reqs).run()
    snap = rec.snaps[4000.0]
    current = "static:" + short(node_topology(snap.nodes[0]))
    statics = fitting_static_policies(config)
    scored = score_layouts(rec, snap, statics)
    assert [s.policy for s in scored] == statics
    by = {s.policy: s for s in scored}
    if current in by:  # the current layout is a static layout: it gains nothing over itself
        cur = node_topology(snap.nodes[0])
        change = rec.config.reconfig_lambda_per_ms * reconfig_ms(
            rec.cost_for(snap.nodes[0]), cur.groups, snap.nodes[0], rec.node_load(snap, snap.nodes[0])
        )
        assert abs(by[current].worth + change) < 1e-9  # its score less the cost of a no-op change
    # the terms are fractions, and the score recorded with them is the policy's score without them
    node = snap.nodes[0]
    load = rec.node_load(snap, node)
    cost = rec.cost_for(node)
    for s in scored:
        assert all(0.0 <= x <= 1.0 for t in s.terms.values() for x in t)
    top = layout_topology(
        next(lay for lay in static_layouts(8, (1, 2, 4, 8)) if layout_name(lay) == scored[3].policy[7:])
    )
    assert rec.evaluate_groups(cost, top.groups, load, node).score == scored[3].score
    assert load.streams and all(s.terms for s in scored)


def test_a_study_point_scores_every_static_layout_beside_its_simulated_goodput():
    config = ClusterConfig(device_kind="cpu", model="tiny")
    statics = fitting_static_policies(config)
    rows, summary = study_point(
        config, 8.0, 6.0, (3.0,), 0, Progress(len(statics) + 1, "t", stream=open("/dev/null", "w"))
    )
    assert sorted(r["policy"] for r in rows) == sorted(statics)
    assert len(summary) == 1 and summary[0]["sim_best_wg"] == max(r["sim_wg"] for r in rows)
    assert 1 <= summary[0]["sim_best_est_rank"] <= len(statics)
