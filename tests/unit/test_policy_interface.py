"""Topology text form and validation, the policy registry, and the static baselines' layouts."""

import pytest

from nitsum.policy.decisions import Policy
from nitsum.policy.registry import make_policy
from nitsum.policy.snapshot import ClusterSnapshot, GroupView, NodeView
from nitsum.topology import Group, Topology


def node(groups=None, n=8, min_tp=1, max_tp=8, kind="h100", last=None):
    groups = groups or (GroupView("n0/d0-tp8", tuple(range(8)), 8, "hybrid"),)
    return NodeView("n0", n, min_tp, max_tp, tuple(groups), kind, last)


def test_topology_round_trips_through_text():
    text = "[0-3 TP4 hybrid][4-5 TP2 decode][6 TP1 decode][7 TP1 prefill]"
    t = Topology.parse(text)
    assert str(t) == text
    assert t.shape() == ((0, 4), (4, 2), (6, 1), (7, 1))
    assert Topology.parse("[7-7 TP1 prefill] [0-3 TP4 hybrid][4-5 tp2 DECODE][6 TP1 decode]") == t
    t.validate(8, 1, 8)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[0-3 TP4 hybrid][4-5 TP2 decode]", "node has 8"),
        ("[0-3 TP4 hybrid][4-7 TP4 decode][6-7 TP2 decode]", "gap or overlap"),
        ("[0-1 TP2 hybrid][2-5 TP4 hybrid][6-7 TP2 hybrid]", "not aligned"),
        ("[0-7 TP8 hybrid]", "between 1 and 4"),
    ],
)
def test_topology_validate_names_the_problem(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        Topology.parse(text).validate(8, 1, 4)


@pytest.mark.parametrize("text", ["", "[0-3 TP2 hybrid]", "[0-3 TP4 sideways]", "[0-3 TP4 hybrid] junk"])
def test_topology_parse_rejects_garbage(text):
    with pytest.raises(ValueError):
        Topology.parse(text)


@pytest.mark.parametrize(
    "spec, layout",
    [
        ("static-tp:2", "[0-1 TP2 hybrid][2-3 TP2 hybrid][4-5 TP2 hybrid][6-7 TP2 hybrid]"),
        ("static-tp:8", "[0-7 TP8 hybrid]"),
        ("disagg", "[0-3 TP4 prefill][4-5 TP2 decode][6-7 TP2 decode]"),
        ("disagg:4/1", "[0-3 TP4 prefill][4 TP1 decode][5 TP1 decode][6 TP1 decode][7 TP1 decode]"),
        ("static-hybrid:4/2", "[0-3 TP4 hybrid][4-5 TP2 hybrid][6-7 TP2 hybrid]"),
    ],
)
def test_baseline_layouts(spec, layout):
    p = make_policy(spec)
    assert isinstance(p, Policy)
    assert p.name == spec
    assert str(p.initial_topology(node())) == layout


def test_static_policy_keeps_its_layout_and_restores_it_otherwise():
    p = make_policy("static-tp:8")
    snap = ClusterSnapshot(0.0, (node(),))
    [d] = p.decide_topology(snap)
    assert (d.target, d.path) == (None, "static")
    split = [GroupView(f"g{i}", (2 * i, 2 * i + 1), 2, "hybrid") for i in range(4)]
    [d] = p.decide_topology(ClusterSnapshot(0.0, (node(split),)))
    assert str(d.target) == "[0-7 TP8 hybrid]"


@pytest.mark.parametrize("spec", ["", "fast", "static-tp", "static-tp:3", "static-tp:x", "disagg:4", "adaptive:2"])
def test_bad_policy_spec_raises_naming_it(spec):
    with pytest.raises(ValueError, match="spec"):
        make_policy(spec)


def test_static_tp_above_max_tp_is_refused():
    with pytest.raises(ValueError, match="not an allowed level"):
        make_policy("static-tp:8").initial_topology(node(max_tp=4))


def test_group_devices():
    assert Group(4, 2, "decode").devices == (4, 5)
