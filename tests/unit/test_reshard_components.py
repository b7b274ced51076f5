"""Components of a topology change: the parts that share no worker, each exchanged and cut over on its own."""

import pytest

from nitsum.kv.reshard import component_of, local_target, transition_span
from nitsum.topology import Group, Topology

TP1 = Topology.uniform(4, 1)
TP2 = Topology.uniform(4, 2)
TP4 = Topology.uniform(4, 4)
MIXED = Topology.of(4, [(0, 2), (2, 1), (3, 1)])


def test_two_independent_splits_are_two_components():
    assert [component_of(TP2, TP1, w) for w in range(4)] == [Group(0, 2)] * 2 + [Group(2, 2)] * 2
    assert local_target(TP2, TP1, 0) == Topology.of(4, [(0, 1), (1, 1), (2, 2)])  # its part; the other pair as it was
    assert local_target(TP2, TP1, 3) == MIXED
    assert transition_span(TP2, local_target(TP2, TP1, 0)) == Group(0, 2)  # not the whole node
    assert transition_span(TP2, TP1) == Group(0, 4)


@pytest.mark.parametrize("old, new", [(TP1, TP4), (TP4, TP2), (TP2, TP4), (TP4, TP1), (MIXED, TP4)])
def test_a_merge_or_a_split_of_one_group_is_one_component(old, new):
    assert {component_of(old, new, w) for w in range(4)} == {Group(0, 4)}
    assert all(local_target(old, new, w) == new for w in range(4))


def test_unchanged_workers_have_no_component_and_keep_the_old_topology():
    new = Topology.of(4, [(0, 2), (2, 2)])  # MIXED -> 2xTP2: only [2][3] merge
    assert [component_of(MIXED, new, w) for w in range(4)] == [None, None, Group(2, 2), Group(2, 2)]
    assert local_target(MIXED, new, 0) == MIXED
    assert local_target(MIXED, new, 2) == new


def test_components_of_an_eight_worker_change():
    old = Topology.of(8, [(0, 4), (4, 2), (6, 1), (7, 1)])
    new = Topology.of(8, [(0, 2), (2, 2), (4, 1), (5, 1), (6, 2)])
    assert [component_of(old, new, w) for w in range(8)] == [Group(0, 4)] * 4 + [Group(4, 2)] * 2 + [Group(6, 2)] * 2
    assert local_target(old, new, 5) == Topology.of(8, [(0, 4), (4, 1), (5, 1), (6, 1), (7, 1)])
