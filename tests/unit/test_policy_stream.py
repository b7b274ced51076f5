"""The adaptive policy's estimator with measured arrival streams, P/D head-of-line delay, and a hand-off in
flight (estimate.py rules 5 and the prefill-batch term; ALGORITHMS.md §1.5)."""

from __future__ import annotations

import pytest

from nitsum.policy.costmodel import cost_model
from nitsum.policy.estimate import classes_of, evaluate, summarize
from nitsum.policy.snapshot import ArrivalStats, ClusterSnapshot, GroupView, NodeView, RequestView, group_id_of
from nitsum.topology import Topology

TP8 = "[0-7 TP8 hybrid]"
TP4X2 = "[0-3 TP4 hybrid][4-7 TP4 hybrid]"
PD = "[0-3 TP4 prefill][4-7 TP4 decode]"
PROMPTS = (400, 1000, 1200, 2000)  # Azure-conv-like quartile midpoints


def node(top: str) -> NodeView:
    groups = tuple(
        GroupView(group_id_of("n0", g.start, g.tp), g.devices, g.tp, g.role) for g in Topology.parse(top).groups
    )
    return NodeView("n0", 8, 1, 8, groups, "h100")


def stream_snapshot(rate_per_s: float, requests=()) -> ClusterSnapshot:
    arrivals = (
        ArrivalStats("interactive", 0.3 * rate_per_s, 200.0, 25.0, 10.0, PROMPTS, 200.0),
        ArrivalStats("background", 0.7 * rate_per_s, 10_000.0, 100.0, 1.0, PROMPTS, 200.0),
    )
    return ClusterSnapshot(0.0, (node(TP8),), tuple(requests), arrivals=arrivals)


def score(top: str, snap: ClusterSnapshot, prefill_batch_tokens: int = 0):
    load = summarize(snap, snap.nodes[0], 1000.0)
    cost = cost_model("llama-3-70b", "h100")
    return evaluate(cost, classes_of(Topology.parse(top).groups), load, 5000.0, 512, prefill_batch_tokens)


def test_measure_takes_rate_quantile_slice_means_and_mean_output():
    a = ArrivalStats.measure(
        "bg", 2000.0, 10_000.0, 100.0, 1.0, [(p, 10 * i) for i, p in enumerate(range(100, 900, 100))]
    )
    assert a.rate_per_s == 4.0  # 8 arrivals in 2 s
    assert a.prompt_tokens == (150, 350, 550, 750)  # means of four equal-mass slices of 100..800
    assert a.output_tokens == 35.0


def test_stream_shows_a_layout_that_cannot_keep_up():
    # 20 req/s: one TP8 group cannot prefill 23 k tokens/s (all-reduce costs it ~1/3 of its prefill rate);
    # two TP4 groups can. The backlog alone (empty here) says nothing.
    busy = stream_snapshot(20.0)
    tp8, tp4 = score(TP8, busy), score(TP4X2, busy)
    assert tp4.score > tp8.score and tp8.misses > tp4.misses
    # At 4 req/s both keep up; TP8 then loses nothing (its faster prefill fits every interactive quantile).
    light = stream_snapshot(4.0)
    assert score(TP8, light).score >= score(TP4X2, light).score
    # Without measured arrivals there is no stream term.
    assert score(TP8, ClusterSnapshot(0.0, (node(TP8),))).score == 0.0


def test_prefill_batches_delay_interactive_on_a_prefill_group():
    # A prefill group batches what waits (up to 8192 tokens): a new prompt first waits out the step in progress.
    # At 4 req/s the TP4 prefill group is ~30 % busy: a little later, no quantile past its target; at 8 req/s
    # some are (rule 18: the wait is the steady batch's, not a full batch's).
    light = stream_snapshot(4.0)
    assert score(PD, light, prefill_batch_tokens=8192).score < score(PD, light).score
    busy = stream_snapshot(8.0)
    with_hol, without = score(PD, busy, prefill_batch_tokens=8192), score(PD, busy)
    assert with_hol.misses > without.misses and with_hol.score < without.score


def test_summarize_skips_a_request_between_groups():
    # Prefilled, on its way to a decode group (group_id None): no group holds its KV; summarize used to crash
    # sorting a None group id among the others.
    on_group = RequestView("a", "interactive", 200.0, 25.0, 10.0, 0.0, 100, 10, 2, 50.0, group_id_of("n0", 0, 8))
    in_flight = RequestView("b", "interactive", 200.0, 25.0, 10.0, 0.0, 100, 10, 1, 60.0, None)
    load = summarize(ClusterSnapshot(100.0, (node(TP8),), (on_group, in_flight)), node(TP8), 1000.0)
    assert load.kv_tokens_by_group == ((group_id_of("n0", 0, 8), 102),)


@pytest.mark.parametrize("nodes, share", [(1, 1.0), (4, 0.25)])
def test_each_node_expects_its_share_of_the_stream(nodes, share):
    snap = stream_snapshot(20.0)
    many = ClusterSnapshot(
        0.0, tuple(NodeView(f"n{i}", 8, 1, 8, node(TP8).groups, "h100") for i in range(nodes)), arrivals=snap.arrivals
    )
    load = summarize(many, many.nodes[0], 1000.0)
    assert [s.rate_per_ms for s in load.streams] == pytest.approx([6.0 * share / 1e3, 14.0 * share / 1e3])


def test_background_leaves_its_low_tp_lane_once_the_queue_eats_half_its_budget():
    from nitsum.policy.base import PolicyConfig
    from nitsum.policy.costmodel import model_spec
    from nitsum.policy.registry import make_policy

    pol = make_policy("adaptive", PolicyConfig(model=model_spec("llama-3-70b")))
    lane = GroupView(group_id_of("n0", 0, 4), (0, 1, 2, 3), 4, "hybrid")  # the low-TP lane
    big = GroupView(group_id_of("n1", 0, 8), tuple(range(8)), 8, "hybrid")
    nodes = (NodeView("n0", 4, 1, 4, (lane,), "h100"), NodeView("n1", 8, 1, 8, (big,), "h100"))
    new = RequestView("new", "background", 10_000.0, 100.0, 1.0, 0.0, 1000, 100)

    def queued(n):
        return tuple(
            RequestView(f"q{i}", "background", 10_000.0, 100.0, 1.0, 0.0, 1000, 100, group_id=lane.group_id)
            for i in range(n)
        )

    # 20 queued prompts (~1.9 s of TP4 prefill): background keeps to the low-TP lane.
    assert pol.route(ClusterSnapshot(0.0, nodes, queued(20)), new).group_id == lane.group_id
    # 50 (~6.4 s): it would still meet its 10 s TTFT there (the old rule sent it), but with under half the
    # budget to spare it goes to the idle TP8 group instead of deepening the lane's queue.
    assert pol.route(ClusterSnapshot(0.0, nodes, queued(50)), new).group_id == big.group_id


def test_arrival_window_detects_a_shift_of_the_stream_and_not_poisson_noise():
    import random

    from nitsum.policy.snapshot import ArrivalWindow

    def shifts(rates_per_s, seconds_each, seed):
        rng, times, t0 = random.Random(seed), [], 0.0
        for rate in rates_per_s:  # Poisson arrivals, each phase at its rate
            t = t0
            while rate > 0 and (t := t + rng.expovariate(rate / 1000.0)) < t0 + seconds_each * 1000.0:
                times.append(t)
            t0 += seconds_each * 1000.0
        w, out, i = ArrivalWindow(5000.0, started_ms=0.0, detect_shifts=True), [], 0
        for now in range(1000, int(t0) + 1, 1000):  # one epoch a second
            while i < len(times) and times[i] <= now:
                w.add(times[i], "interactive", 200.0, 25.0, 10.0, 100, 10)
                i += 1
            w.stats(float(now))
            if w.shift_ms not in [s for s, _ in out]:
                out.append((w.shift_ms, w.shift_stopped))
        return out

    for seed in range(3):
        assert shifts([8.0, 8.0, 8.0], 60.0, seed) == [(0.0, False)]  # the start only: a steady stream does not shift
        found = shifts([8.0, 1.0, 8.0], 60.0, seed)
        assert [s for s, _ in found][:1] == [0.0] and len(found) == 3
        assert 55_000 <= found[1][0] <= 65_000 and 115_000 <= found[2][0] <= 125_000
        assert found[2][1] is False  # a rise (a fall to 1/s may look like a stop until its next arrival)
        # The end of the stream is a shift at which it has stopped.
        for rate in (8.0, 20.0):  # (at 2/s the end is within 3 sigma of a 5 s window: no shift at all)
            ended = shifts([rate, 0.0], 60.0, seed)
            assert len(ended) == 2 and 55_000 <= ended[1][0] <= 65_000 and ended[1][1] is True, (rate, ended)
    # Without detect_shifts (the coordinator today) nothing is tracked.
    w = ArrivalWindow(5000.0)
    w.add(0.0, "interactive", 200.0, 25.0, 10.0, 100, 10)
    w.stats(1000.0)
    assert w.shift_ms is None and w.shift_stopped is None


def test_the_estimate_names_the_part_of_its_score_the_stream_brings():
    # Rule 19 weighs the two parts differently (the stream recurs every horizon of the phase, the backlog is
    # earned once), so the split must be exact: the score without arrivals is the backlog part.
    running = RequestView("a", "interactive", 200.0, 25.0, 10.0, 0.0, 100, 50, 10, 50.0, group_id_of("n0", 0, 8))
    with_stream = score(TP8, stream_snapshot(8.0, (running,)))
    backlog_only = score(TP8, ClusterSnapshot(0.0, (node(TP8),), (running,)))
    assert with_stream.stream > 0 and backlog_only.stream == 0 and backlog_only.score > 0
    assert with_stream.score - with_stream.stream == pytest.approx(backlog_only.score)


def test_a_refreshing_window_answers_from_its_last_measurement_until_refresh_ms():
    from nitsum.policy.snapshot import ArrivalWindow

    w = ArrivalWindow(5000.0, started_ms=0.0, refresh_ms=50.0)
    w.add(1000.0, "interactive", 200.0, 25.0, 10.0, 100, 10)
    first = w.stats(1000.0)
    w.add(1010.0, "interactive", 200.0, 25.0, 10.0, 300, 10)
    assert w.stats(1040.0) is first  # within 50 ms: the same measurement
    later = w.stats(1050.0)
    assert later is not first and later[0].rate_per_s > first[0].rate_per_s * 1.5  # both arrivals counted
    plain = ArrivalWindow(5000.0, started_ms=0.0)  # the simulator's: measured at every call
    plain.add(1000.0, "interactive", 200.0, 25.0, 10.0, 100, 10)
    assert plain.stats(1000.0) is not plain.stats(1000.0)
    with pytest.raises(AssertionError):
        ArrivalWindow(5000.0, refresh_ms=50.0, detect_shifts=True)
