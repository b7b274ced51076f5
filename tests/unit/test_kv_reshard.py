"""KV reshard planner: exact transfers for merges, splits and the replicated-KV-head (GQA) case."""

import pytest

from nitsum.kv.reshard import (
    KVGeometry,
    Placement,
    RequestKV,
    Transfer,
    changed_groups,
    component_of,
    count_moved_bytes,
    kv_head_range,
    local_target,
    place_requests,
    plan_commit,
    plan_prepare,
    transition_span,
)
from nitsum.topology import Group, Topology

GEO = KVGeometry(num_layers=2, num_kv_heads=4, block_size=4)
POOL = {1: 16, 2: 16, 4: 16}


def T(src, dst, h0, h1, a, b, layers=2):
    return Transfer(src, dst, 0, layers, h0, h1, tuple(a), tuple(b))


def test_topology_validates_alignment_and_partition():
    assert Topology.of(4, [(2, 2), (0, 2)]).groups == (Group(0, 2), Group(2, 2))
    with pytest.raises(ValueError, match="aligned"):
        Topology.of(4, [(0, 1), (1, 2), (3, 1)])
    with pytest.raises(ValueError, match="partition"):
        Topology.of(4, [(0, 2)])
    with pytest.raises(ValueError, match="power of two"):
        Topology.of(3, [(0, 3)])


def test_head_ranges_split_and_replicate():
    assert [kv_head_range(4, 2, p) for p in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(4, 4, p) for p in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [kv_head_range(2, 4, p) for p in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert kv_head_range(4, 1, 0) == (0, 4)


def test_span_is_smallest_aligned_group_over_changed_workers():
    assert transition_span(Topology.uniform(4, 1), Topology.of(4, [(0, 2), (2, 1), (3, 1)])) == Group(0, 2)
    assert transition_span(Topology.of(8, [(0, 4), (4, 2), (6, 2)]), Topology.uniform(8, 4)) == Group(4, 4)
    assert transition_span(Topology.of(4, [(0, 1), (1, 1), (2, 2)]), Topology.of(4, [(0, 2), (2, 1), (3, 1)])) == Group(
        0, 4
    )
    assert transition_span(Topology.uniform(4, 2), Topology.uniform(4, 2)) is None


def test_merge_two_tp2_into_tp4_precopy_then_delta():
    old, new = Topology.uniform(4, 2), Topology.uniform(4, 4)
    reqs = [RequestKV("a", Group(0, 2), 10, (5, 6, 7)), RequestKV("b", Group(2, 2), 8, (0, 1))]
    plan = plan_prepare(old, new, reqs, GEO, POOL)
    assert plan.placements == (
        Placement("a", Group(0, 2), Group(0, 4), (0, 1), 8),
        Placement("b", Group(2, 2), Group(0, 4), (2, 3), 8),
    )
    # Only full blocks move at prepare: a's partial block 7 waits for the delta.
    assert plan.transfers == (
        T(0, 0, 0, 1, [5, 6], [0, 1]),
        T(0, 1, 1, 2, [5, 6], [0, 1]),
        T(1, 2, 2, 3, [5, 6], [0, 1]),
        T(1, 3, 3, 4, [5, 6], [0, 1]),
        T(2, 0, 0, 1, [0, 1], [2, 3]),
        T(2, 1, 1, 2, [0, 1], [2, 3]),
        T(3, 2, 2, 3, [0, 1], [2, 3]),
        T(3, 3, 3, 4, [0, 1], [2, 3]),
    )
    assert plan.num_moved_blocks == {"a": 2, "b": 2}

    # At the step boundary: a decoded to 13 tokens, b finished, c arrived in the second group.
    now = [RequestKV("a", Group(0, 2), 13, (5, 6, 7, 8)), RequestKV("c", Group(2, 2), 3, (4,))]
    delta = plan_commit(plan, now, GEO, POOL)
    # b's pre-copied blocks 2, 3 went back to the pool's tail; fresh blocks come from its head.
    assert delta.placements == (
        Placement("a", Group(0, 2), Group(0, 4), (0, 1, 4, 5), 13),
        Placement("c", Group(2, 2), Group(0, 4), (6,), 3),
    )
    assert delta.transfers == (
        T(0, 0, 0, 1, [7, 8], [4, 5]),
        T(0, 1, 1, 2, [7, 8], [4, 5]),
        T(1, 2, 2, 3, [7, 8], [4, 5]),
        T(1, 3, 3, 4, [7, 8], [4, 5]),
        T(2, 0, 0, 1, [4], [6]),
        T(2, 1, 1, 2, [4], [6]),
        T(3, 2, 2, 3, [4], [6]),
        T(3, 3, 3, 4, [4], [6]),
    )
    # Cross-worker bytes: 2 of the 8 transfers per request are local copies (0->0, 3->3).
    per_block_head = 2 * GEO.num_layers * GEO.block_size * 16 * 4
    assert count_moved_bytes(delta, GEO, head_dim=16, itemsize=4) == (3 * 2 + 3 * 1) * per_block_head


def test_split_tp4_into_two_tp2_balances_tokens():
    old, new = Topology.uniform(4, 4), Topology.uniform(4, 2)
    reqs = [
        RequestKV("r1", Group(0, 4), 20, (0, 1, 2, 3, 4)),
        RequestKV("r2", Group(0, 4), 5, (5, 6)),
        RequestKV("r3", Group(0, 4), 9, (7, 8, 9)),
    ]
    assert place_requests(reqs, old, new) == {"r1": Group(0, 2), "r2": Group(2, 2), "r3": Group(2, 2)}
    plan = plan_prepare(old, new, reqs, GEO, POOL)
    assert [(p.request_id, p.dst_group, p.dst_block_ids) for p in plan.placements] == [
        ("r1", Group(0, 2), (0, 1, 2, 3, 4)),
        ("r2", Group(2, 2), (0,)),
        ("r3", Group(2, 2), (1, 2)),
    ]
    r1 = ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    r23 = ([5, 7, 8], [0, 1, 2])
    assert plan.transfers == (
        T(0, 0, 0, 1, *r1),
        T(0, 2, 0, 1, *r23),
        T(1, 0, 1, 2, *r1),
        T(1, 2, 1, 2, *r23),
        T(2, 1, 2, 3, *r1),
        T(2, 3, 2, 3, *r23),
        T(3, 1, 3, 4, *r1),
        T(3, 3, 3, 4, *r23),
    )


def test_four_tp1_merge_into_tp4_and_back():
    tp1, tp4 = Topology.uniform(4, 1), Topology.uniform(4, 4)
    reqs = [RequestKV(f"q{w}", Group(w, 1), 4, (w,)) for w in range(4)]
    merge = plan_prepare(tp1, tp4, reqs, GEO, POOL)
    # Worker w keeps head w of its own request and receives head w of the three others.
    assert merge.transfers == tuple(T(src, dst, dst, dst + 1, [src], [src]) for src in range(4) for dst in range(4))
    back = [RequestKV(f"q{w}", Group(0, 4), 4, (w,)) for w in range(4)]
    split = plan_prepare(tp4, tp1, back, GEO, POOL)
    assert {p.request_id: p.dst_group for p in split.placements} == {f"q{w}": Group(w, 1) for w in range(4)}
    # A TP1 worker gathers all four heads, one from each former peer.
    assert split.transfers == tuple(T(src, dst, src, src + 1, [dst], [0]) for src in range(4) for dst in range(4))


def test_gqa_replicated_heads_come_from_self_when_possible():
    geo = KVGeometry(num_layers=1, num_kv_heads=2, block_size=4)
    merge = plan_prepare(
        Topology.uniform(4, 2),
        Topology.uniform(4, 4),
        [RequestKV("a", Group(0, 2), 4, (3,)), RequestKV("b", Group(2, 2), 4, (3,))],
        geo,
        POOL,
    )
    assert merge.transfers == (
        T(0, 0, 0, 1, [3], [0], 1),
        T(0, 1, 0, 1, [3], [0], 1),
        T(1, 2, 1, 2, [3], [0], 1),
        T(1, 3, 1, 2, [3], [0], 1),
        T(2, 0, 0, 1, [3], [1], 1),
        T(2, 1, 0, 1, [3], [1], 1),
        T(3, 2, 1, 2, [3], [1], 1),
        T(3, 3, 1, 2, [3], [1], 1),
    )
    split = plan_prepare(
        Topology.uniform(4, 4), Topology.uniform(4, 2), [RequestKV("a", Group(0, 4), 4, (2,))], geo, POOL
    )
    # Head 0 lives on workers 0 and 1, head 1 on 2 and 3 (replicated at TP4): worker 0 and 3 copy
    # locally, worker 1 takes head 1 from worker 3 (its position 1 picks the second holder).
    assert split.transfers == (T(0, 0, 0, 1, [2], [0], 1), T(3, 1, 1, 2, [2], [0], 1))


def test_shared_prefix_blocks_move_once_and_stay_shared():
    reqs = [RequestKV("a", Group(0, 1), 9, (3, 4, 5)), RequestKV("b", Group(0, 1), 8, (3, 7))]
    plan = plan_prepare(Topology.of(2, [(0, 1), (1, 1)]), Topology.uniform(2, 2), reqs, KVGeometry(1, 2, 4), {2: 8})
    assert [p.dst_block_ids for p in plan.placements] == [(0, 1), (0, 2)]
    assert plan.transfers == (T(0, 0, 0, 1, [3, 4, 7], [0, 1, 2], 1), T(0, 1, 1, 2, [3, 4, 7], [0, 1, 2], 1))


def test_no_room_means_recompute_never_drop():
    reqs = [RequestKV("big", Group(0, 4), 12, (0, 1, 2)), RequestKV("small", Group(0, 4), 4, (3,))]
    plan = plan_prepare(Topology.uniform(4, 4), Topology.of(4, [(0, 2), (2, 2)]), reqs, GEO, {2: 2})
    assert plan.placements == (
        Placement("big", Group(0, 4), Group(0, 2), (), 0, recompute=True),
        Placement("small", Group(0, 4), Group(2, 2), (0,), 4),
    )
    assert {t.dst_worker for t in plan.transfers} == {2, 3}


def test_commit_moves_afresh_a_request_preempted_since_prepare():
    old, new = Topology.uniform(2, 1), Topology.uniform(2, 2)
    geo = KVGeometry(1, 2, 4)
    plan = plan_prepare(old, new, [RequestKV("a", Group(0, 1), 8, (0, 1))], geo, {2: 8})
    assert plan.num_moved_blocks == {"a": 2}
    # Preempted and re-run into other blocks: the pre-copied table no longer holds.
    delta = plan_commit(plan, [RequestKV("a", Group(0, 1), 9, (4, 5, 6))], geo, {2: 8})
    assert delta.placements == (Placement("a", Group(0, 1), Group(0, 2), (2, 3, 4), 9),)
    assert delta.transfers[0] == T(0, 0, 0, 1, [4, 5, 6], [2, 3, 4], 1)


def test_unchanged_groups_are_left_alone():
    old = Topology.of(4, [(0, 2), (2, 1), (3, 1)])
    new = Topology.of(4, [(0, 2), (2, 2)])
    reqs = [RequestKV("stay", Group(0, 2), 8, (0, 1)), RequestKV("go", Group(3, 1), 4, (0,))]
    plan = plan_prepare(old, new, reqs, GEO, POOL)
    assert [p.request_id for p in plan.placements] == ["go"]
    assert {t.src_worker for t in plan.transfers} == {3}


def test_a_role_only_change_moves_no_kv():
    old = Topology.of(4, [(0, 2), (2, 2)], roles=["prefill", "decode"])
    new = Topology.of(4, [(0, 2), (2, 2)], roles=["prefill", "hybrid"])  # only the second group's role
    assert old != new
    reqs = [RequestKV("p", Group(0, 2), 8, (0, 1)), RequestKV("d", Group(2, 2, "decode"), 6, (3, 4))]
    assert changed_groups(old, new) == ((), ())
    assert transition_span(old, new) is None
    assert [component_of(old, new, w) for w in range(4)] == [None] * 4
    assert local_target(old, new, 2) == old
    assert place_requests(reqs, old, new) == {}
    plan = plan_prepare(old, new, reqs, GEO, POOL)
    assert plan.placements == () and plan.transfers == ()
    delta = plan_commit(plan, reqs, GEO, POOL)
    assert delta.placements == () and delta.transfers == ()


def test_a_roled_group_that_changes_moves_its_requests_reported_without_role():
    old = Topology.of(4, [(0, 2), (2, 2)], roles=["prefill", "decode"])
    new = Topology.of(4, [(0, 2), (2, 1), (3, 1)], roles=["hybrid", "decode", "decode"])
    # As the wire decodes them: groups without their role.
    reqs = [RequestKV("p", Group(0, 2), 8, (0, 1)), RequestKV("d", Group(2, 2), 4, (3,))]
    assert changed_groups(old, new) == ((Group(2, 2, "decode"),), (Group(2, 1, "decode"), Group(3, 1, "decode")))
    assert transition_span(old, new) == Group(2, 2)
    assert place_requests(reqs, old, new) == {"d": Group(2, 1, "decode")}
    plan = plan_prepare(old, new, reqs, GEO, POOL)
    assert [p.request_id for p in plan.placements] == ["d"] and plan.transfers
