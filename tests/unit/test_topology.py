"""The one Group and Topology: text form, validation, partitions, equality by value, span without role."""

import pytest

from nitsum.topology import ROLES, Group, Topology


def test_group_geometry_and_text():
    g = Group(4, 2, "decode")
    assert (g.end, g.devices, list(g.workers), g.leader, g.span) == (5, (4, 5), [4, 5], 4, (4, 2))
    assert str(g) == "[4-5 TP2 decode]" and str(Group(6, 1)) == "[6 TP1 hybrid]"
    assert Group(0, 2).role == "hybrid" and "hybrid" in ROLES


def test_equality_is_by_value_including_role_and_span_ignores_role():
    assert Group(0, 2, "decode") == Group(0, 2, "decode") and hash(Group(0, 2)) == hash(Group(0, 2, "hybrid"))
    assert Group(0, 2, "decode") != Group(0, 2, "prefill")
    assert Group(0, 2, "decode").span == Group(0, 2, "prefill").span == (0, 2)
    a = Topology.of(4, [(0, 2), (2, 2)], roles=["prefill", "decode"])
    assert a == Topology((Group(2, 2, "decode"), Group(0, 2, "prefill")))  # canonical order
    assert a != Topology.of(4, [(0, 2), (2, 2)])
    assert a.shape() == Topology.uniform(4, 2).shape() == ((0, 2), (2, 2))


def test_parse_round_trips_and_counts_devices():
    text = "[0-3 TP4 hybrid][4-5 TP2 decode][6 TP1 decode][7-7 TP1 prefill]"
    t = Topology.parse(text)
    assert str(t) == "[0-3 TP4 hybrid][4-5 TP2 decode][6 TP1 decode][7 TP1 prefill]"
    assert Topology.parse(str(t)) == t
    assert t.num_devices == t.num_workers == 8
    assert t.group_of(5) == Group(4, 2, "decode") and t.pairs() == [[0, 4], [4, 2], [6, 1], [7, 1]]
    with pytest.raises(KeyError):
        t.group_of(8)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[0-3 TP2 hybrid]", "spans 4 devices but says TP2"),
        ("[0-1 TP2 leader]", "unknown role 'leader'"),
        ("[0-1 TP2 hybrid] junk", "cannot parse topology"),
        ("junk [0-1 TP2 hybrid]", "near 'junk '"),
        ("", "cannot parse topology"),
    ],
)
def test_parse_refuses_bad_text(text, message):
    with pytest.raises(ValueError, match=message):
        Topology.parse(text)


@pytest.mark.parametrize(
    "groups, kwargs, message",
    [
        ((), {}, "no groups"),
        ((Group(0, 4, "leader"),), {}, "role must be one of"),
        ((Group(0, 3),), {"num": 3}, "power of two"),
        ((Group(0, 4),), {"max_tp": 2}, "TP must be between 1 and 2"),
        ((Group(0, 1), Group(1, 2), Group(3, 1)), {}, "not aligned"),
        ((Group(0, 2), Group(4, 2)), {}, "expected a group starting at device 2"),
        ((Group(0, 2),), {}, "covers devices 0-1, node has 4"),
    ],
)
def test_validate_refuses_what_is_not_an_aligned_partition(groups, kwargs, message):
    num = kwargs.pop("num", 4)
    with pytest.raises(ValueError, match=message):
        Topology(groups).validate(num, **kwargs)
    Topology.uniform(4, 2, "decode").validate(4)


def test_of_refuses_a_non_partition_with_a_clear_message():
    assert Topology.of(4, [(2, 2), (0, 2)]).groups == (Group(0, 2), Group(2, 2))
    with pytest.raises(ValueError, match=r"groups \[0-1 TP2 hybrid\] do not partition workers 0\.\.3"):
        Topology.of(4, [(0, 2)])
    with pytest.raises(ValueError, match=r"do not partition workers 0\.\.3"):
        Topology.of(4, [(0, 2), (0, 2), (2, 2)])  # an overlap
    with pytest.raises(ValueError, match="not aligned"):
        Topology.of(4, [(0, 1), (1, 2), (3, 1)])
    with pytest.raises(ValueError, match="power of two"):
        Topology.of(3, [(0, 3)])
    with pytest.raises(ValueError, match="1 roles for 2 groups"):
        Topology.of(4, [(0, 2), (2, 2)], roles=["decode"])


def test_of_and_uniform_take_roles():
    assert Topology.of(2, [(0, 1), (1, 1)], roles=("prefill", "decode")).groups == (
        Group(0, 1, "prefill"),
        Group(1, 1, "decode"),
    )
    assert Topology.of(2, [(0, 2)], roles=()) == Topology.uniform(2, 2) == Topology((Group(0, 2, "hybrid"),))
    assert {g.role for g in Topology.uniform(4, 1, "decode").groups} == {"decode"}
