"""Table-driven tests of the adaptive TP policy (ALGORITHMS.md §1.5) on the cost model's H100 tables."""

from dataclasses import replace

import pytest

from nitsum.policy.base import PolicyConfig
from nitsum.policy.costmodel import model_spec
from nitsum.policy.estimate import classes_of, evaluate, summarize
from nitsum.policy.snapshot import ClusterSnapshot, GroupView, NodeView, RequestView, group_id_of
from nitsum.policy.topology import AdaptivePolicy, candidate_shapes, mean_tp
from nitsum.topology import Group, Topology

TP2X4 = "[0-1 TP2 hybrid][2-3 TP2 hybrid][4-5 TP2 hybrid][6-7 TP2 hybrid]"
TP4X2 = "[0-3 TP4 hybrid][4-7 TP4 hybrid]"
TP8 = "[0-7 TP8 hybrid]"
NOW = 100_000.0


def node_of(top, min_tp=1, last=None, unhealthy=()):
    t = top if isinstance(top, Topology) else Topology.parse(top)
    groups = tuple(
        GroupView(group_id_of("n0", g.start, g.tp), g.devices, g.tp, g.role, healthy=g.start not in unhealthy)
        for g in t.groups
    )
    return NodeView("n0", 8, min_tp, 8, groups, "h100", last)


def inter(i, now=NOW, prompt=1000, age=10.0, **kw):
    return RequestView(f"i{i}", "interactive", 200.0, 25.0, 10.0, now - age, prompt, 200, **kw)


def bg(i, now=NOW, prompt=2000, age=0.0, **kw):
    return RequestView(f"b{i}", "background", 10_000.0, 100.0, 1.0, now - age, prompt, 200, **kw)


def policy(model="llama-3-70b", **kw):
    return AdaptivePolicy(PolicyConfig(model=model_spec(model), **kw))


def decide(pol, top, requests, min_tp=1, now=NOW, last=None):
    [d] = pol.decide_topology(ClusterSnapshot(now, (node_of(top, min_tp, last),), tuple(requests)))
    return d


def test_interactive_surge_consolidates_to_higher_tp():
    # 70B on TP2 H100 groups: a 1000-token prefill and a decode step both miss interactive targets.
    pol = policy()
    d = decide(pol, TP2X4, [inter(i) for i in range(8)], min_tp=2)
    assert d.path == "fast"
    assert d.reason.startswith("interactive surge")
    # Not [0-3 TP4][4-5 TP2][6-7 TP2]: a TP2 group keeps ~8.8 k KV tokens after 70B weights, fewer than
    # MIN_BATCH_SEQS (8) requests of 1.2 k tokens, so TP2 is no candidate level for this load.
    assert str(d.target) == "[0-3 TP4 hybrid][4-7 TP4 hybrid]"
    assert mean_tp(d.target.shape()) > mean_tp(Topology.parse(TP2X4).shape())
    # The estimator agrees the consolidated layout serves the surge and the old one did not.
    snap = ClusterSnapshot(NOW, (node_of(TP2X4, 2),), tuple(inter(i) for i in range(8)))
    load = summarize(snap, snap.nodes[0], 1000.0)
    cost = pol.cost_for(snap.nodes[0])
    before = evaluate(cost, classes_of(Topology.parse(TP2X4).groups), load, 5000.0, 512)
    after = evaluate(cost, classes_of(d.target.groups), load, 5000.0, 512)
    # Four of eight make it: two TP4 groups prefill them in time, half of them within 200 ms.
    assert (before.latency_misses, after.latency_misses) == (8, 4)


def test_background_backlog_without_interactive_splits_to_lower_tp():
    # 8B: prefill is compute-bound, so eight TP1 replicas out-prefill one TP8 group (no all-reduce).
    d = decide(policy("llama-3-8b"), TP8, [bg(i, age=i) for i in range(1000)])
    assert d.path == "fast"
    assert d.reason.startswith("throughput backlog")
    assert str(d.target) == "".join(f"[{i} TP1 hybrid]" for i in range(8))


def test_interactive_work_present_blocks_the_split_fast_path():
    d = decide(policy("llama-3-8b"), TP8, [bg(i, age=i) for i in range(1000)] + [inter(0)])
    assert d.path == "scored"


@pytest.mark.parametrize(
    "top, requests, kw, reason",
    [
        (TP4X2, [], {}, "idle"),
        (TP4X2, [inter(0)], {"last": NOW - 1000.0}, "dwell"),
    ],
)
def test_keep_cases(top, requests, kw, reason):
    d = decide(policy(), top, requests, min_tp=2, **kw)
    assert (d.target, d.path) == (None, "fast")
    assert d.reason.startswith(reason)


def test_unhealthy_group_freezes_the_topology():
    snap = ClusterSnapshot(NOW, (node_of(TP2X4, 2, unhealthy=(2,)),), tuple(inter(i) for i in range(8)))
    [d] = policy().decide_topology(snap)
    assert d.target is None and "unhealthy" in d.reason


def _oscillate(cfg, load_a, load_b, start, epochs=20, epoch_ms=1000.0, min_tp=2):
    pol = AdaptivePolicy(cfg)
    top, last, changes = Topology.parse(start), None, []
    for e in range(epochs):
        now = NOW + epoch_ms * e
        reqs = (load_a if e % 2 == 0 else load_b)(now)
        [d] = pol.decide_topology(ClusterSnapshot(now, (node_of(top, min_tp, last),), reqs))
        if d.target is not None:
            top, last = d.target, now
            changes.append(e)
    return changes


TP1X8 = "".join(f"[{i} TP1 hybrid]" for i in range(8))
MILD_A = lambda now: (inter(0, now),) + tuple(bg(i, now) for i in range(10))  # noqa: E731
MILD_B = lambda now: tuple(bg(i, now) for i in range(200))  # noqa: E731
# 8B: an 8000-token interactive prompt misses TTFT at TP1; a 1000-request backlog prefers TP1 replicas.
SURGE = lambda now: tuple(inter(i, now, prompt=8000) for i in range(4))  # noqa: E731
BACKLOG = lambda now: tuple(bg(i, now, age=i) for i in range(1000))  # noqa: E731


def test_margin_prevents_flapping_under_a_mild_oscillation():
    base = PolicyConfig(model=model_spec("llama-3-70b"), min_dwell_ms=0.0)
    assert _oscillate(base, MILD_A, MILD_B, TP4X2) == []
    # This load used to flip [TP4 x2] <-> a layout with TP2 groups every epoch without the margin; TP2 is no
    # longer a candidate for 70B on H100 (MIN_BATCH_SEQS), so it holds even without one. What the margin
    # holds is shown by test_dwell_bounds_changes_under_a_strong_oscillation.
    assert _oscillate(replace(base, hysteresis_margin=0.0, hysteresis_fraction=0.0), MILD_A, MILD_B, TP4X2) == []


def test_dwell_bounds_changes_under_a_strong_oscillation():
    base = PolicyConfig(model=model_spec("llama-3-8b"))
    flapping = _oscillate(
        replace(base, min_dwell_ms=0.0, hysteresis_margin=0.0, hysteresis_fraction=0.0), SURGE, BACKLOG, TP1X8, min_tp=1
    )
    assert flapping == list(range(20))  # every epoch: consolidate, split, consolidate, ...
    changes = _oscillate(replace(base, hysteresis_fraction=0.0), SURGE, BACKLOG, TP1X8, min_tp=1)
    assert changes == [0, 3, 6, 9, 12, 15, 18]  # at most one change per 3 s dwell
    # Defaults: consolidating needs a gain over the margin; splitting for throughput (no interactive work at
    # all) needs no loss and waits two dwell times after the last change. So the 1 s oscillation moves the
    # node 4 times in 20 epochs (consolidate at 0, split at 7, consolidate at 10, split at 17), not 20.
    assert _oscillate(base, SURGE, BACKLOG, TP1X8, min_tp=1) == [0, 7, 10, 17]


def test_decisions_are_deterministic_across_policy_objects():
    reqs = [inter(i, age=i) for i in range(5)] + [bg(i, age=3 * i) for i in range(300)]
    snap = ClusterSnapshot(NOW, (node_of(TP2X4, 2),), tuple(reqs))
    assert policy().decide_topology(snap) == policy().decide_topology(snap)


@pytest.mark.parametrize("start", [TP8, TP2X4, "".join(f"[{i} TP1 decode]" for i in range(8))])
def test_candidates_are_valid_aligned_partitions(start):
    shapes = candidate_shapes(Topology.parse(start).shape(), 8, (1, 2, 4, 8), 2)
    assert shapes and len(set(shapes)) == len(shapes)
    assert Topology.parse(start).shape() not in shapes
    for sh in shapes:
        Topology(tuple(Group(s, k, "hybrid") for s, k in sh)).validate(8, 1, 8)


def test_candidates_respect_min_tp():
    shapes = candidate_shapes(Topology.parse(TP8).shape(), 8, (2, 4, 8), 2)
    assert min(k for sh in shapes for _, k in sh) == 2


def test_initial_topology_is_consolidated():
    assert str(policy().initial_topology(node_of(TP2X4, 2))) == TP8


def test_role_variants_of_equal_tp_groups_include_quarter_and_three_quarter_prefill_splits():
    from nitsum.policy.phases import role_variants

    shape = tuple((i, 1) for i in range(8))
    variants = role_variants(shape, prefill_pending=True)
    prefill_counts = sorted(sum(g.role == "prefill" for g in v) for v in variants)
    assert prefill_counts == [0, 2, 4, 6]  # all hybrid, then 2 / 4 / 6 prefill groups, the rest decode
    assert all(g.role in ("prefill", "hybrid") for g in variants[0]) and all(
        v[0].role in ("prefill", "hybrid") for v in variants
    )
    assert role_variants(shape, prefill_pending=False) == variants[:1]
    assert len(role_variants(((0, 4), (4, 2), (6, 2)), True)) == 2  # mixed TPs: the highest-TP prefill split only
