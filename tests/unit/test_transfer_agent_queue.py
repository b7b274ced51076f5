"""The transfer agent's strict-priority queue: P1 first, FIFO within a level, promotions only upward."""

from __future__ import annotations

from nitsum.transfer.agent import PriorityFlowQueue


def _drain(q: PriorityFlowQueue) -> list[tuple[str, int]]:
    out = []
    while (item := q.pop()) is not None:
        out.append(item)
    return out


def test_strict_priority_then_arrival_order():
    q = PriorityFlowQueue()
    for flow_id, level in (("a", 8), ("b", 3), ("c", 8), ("d", 1), ("e", 3)):
        q.push(flow_id, level)
    assert len(q) == 5
    assert _drain(q) == [("d", 1), ("b", 3), ("e", 3), ("a", 8), ("c", 8)]
    assert len(q) == 0 and q.pop() is None


def test_promotion_moves_up_keeps_arrival_and_never_demotes():
    q = PriorityFlowQueue()
    q.push("a", 4)
    q.push("b", 4)
    q.push("c", 6)
    assert q.promote("c", 4)  # same level as a and b, but it arrived last
    assert not q.promote("a", 5)  # a demotion is ignored
    assert not q.promote("a", 4)
    assert not q.promote("zz", 1)  # not waiting
    assert q.level("c") == 4 and q.level("a") == 4
    assert _drain(q) == [("a", 4), ("b", 4), ("c", 4)]


def test_removed_and_promoted_entries_are_not_returned_twice():
    q = PriorityFlowQueue()
    q.push("a", 5)
    q.push("b", 5)
    assert q.promote("b", 2)
    assert q.remove("a") and not q.remove("a")
    assert "b" in q and "a" not in q
    assert _drain(q) == [("b", 2)]
    q.push("a", 3)  # a flow id may come back after it left
    assert _drain(q) == [("a", 3)]
