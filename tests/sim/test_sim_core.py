"""Event core and flow-level network: ordering, determinism and the analytic checks of issue #7."""

from __future__ import annotations

import random

import pytest

from nitsum.sim.engine import Simulator
from nitsum.sim.network import Network

GBPS = 1e9


def test_events_run_in_time_then_schedule_order_and_handlers_return_next_events():
    sim = Simulator()
    log: list[tuple[float, str]] = []

    def tick(s, name):
        log.append((s.now_ms, name))
        if name == "a":
            return [(s.now_ms + 1.0, tick, "c"), (s.now_ms + 0.5, tick, "d")]
        return None

    sim.schedule(2.0, tick, "b")
    sim.schedule(1.0, tick, "a")
    sim.schedule(2.0, tick, "e")
    assert sim.run() == 5
    # ties at 2.0: b and e were scheduled before c (seq order), d comes at 1.5
    assert log == [(1.0, "a"), (1.5, "d"), (2.0, "b"), (2.0, "e"), (2.0, "c")]


def test_run_until_stops_and_advances_clock():
    sim = Simulator()
    sim.schedule(5.0, lambda s, p: None)
    assert sim.run(until_ms=3.0) == 0 and sim.now_ms == 3.0 and sim.pending == 1
    assert sim.run() == 1 and sim.now_ms == 5.0


def _net_sim(links: dict[str, float]):
    done: dict[str, float] = {}

    def on_done(sim, flow, now):
        done[flow.fid] = now
        return None

    net = Network(on_done)
    for link, gbps in links.items():
        net.add_link(link, gbps * GBPS)
    return Simulator(), net, done


def test_one_flow_on_idle_link_takes_size_over_bandwidth():
    sim, net, done = _net_sim({"l": 100.0})
    net.add_flow("f", ["l"], 1_000_000_000, 0.0)  # 1 GB at 100 Gb/s = 80 ms
    sim.schedule_all(net.commit(0.0))
    sim.run()
    assert done == {"f": pytest.approx(80.0)}


def test_two_equal_flows_share_fairly():
    sim, net, done = _net_sim({"l": 100.0})
    net.add_flow("a", ["l"], 500_000_000, 0.0)
    net.add_flow("b", ["l"], 500_000_000, 0.0)
    sim.schedule_all(net.commit(0.0))
    assert net.rate_bps("a") == pytest.approx(50 * GBPS) and net.rate_bps("b") == pytest.approx(50 * GBPS)
    sim.run()
    assert done == {"a": pytest.approx(80.0), "b": pytest.approx(80.0)}


def test_short_flow_leaves_and_the_other_speeds_up():
    sim, net, done = _net_sim({"l": 100.0})
    net.add_flow("short", ["l"], 250_000_000, 0.0)  # at 50 Gb/s: 40 ms
    net.add_flow("long", ["l"], 750_000_000, 0.0)  # 250 MB by 40 ms, then 500 MB at 100 Gb/s = +40 ms
    sim.schedule_all(net.commit(0.0))
    sim.run()
    assert done == {"short": pytest.approx(40.0), "long": pytest.approx(80.0)}


def test_higher_level_starves_lower_one():
    sim, net, done = _net_sim({"l": 100.0})
    net.add_flow("low", ["l"], 1_000_000_000, 0.0, key=(2,))
    net.add_flow("high", ["l"], 1_000_000_000, 0.0, key=(1,))
    sim.schedule_all(net.commit(0.0))
    assert net.rate_bps("high") == pytest.approx(100 * GBPS) and net.rate_bps("low") == 0.0
    sim.run()
    assert done == {"high": pytest.approx(80.0), "low": pytest.approx(160.0)}


def test_max_min_on_two_links_gives_the_unbottlenecked_flow_the_rest():
    # a: l1 only; b: l1 + l2 where l2 is 20 Gb/s. Max-min: b = 20, a = 80.
    sim, net, _ = _net_sim({"l1": 100.0, "l2": 20.0})
    net.add_flow("a", ["l1"], 1e9, 0.0)
    net.add_flow("b", ["l1", "l2"], 1e9, 0.0)
    net.commit(0.0)
    assert net.rate_bps("b") == pytest.approx(20 * GBPS) and net.rate_bps("a") == pytest.approx(80 * GBPS)


def test_rate_cap_paces_a_flow_and_frees_the_rest():
    sim, net, _ = _net_sim({"l": 100.0})
    net.add_flow("paced", ["l"], 1e9, 0.0, key=(1,), cap_bps=10 * GBPS)
    net.add_flow("bulk", ["l"], 1e9, 0.0, key=(1,))
    net.commit(0.0)
    assert net.rate_bps("paced") == pytest.approx(10 * GBPS) and net.rate_bps("bulk") == pytest.approx(90 * GBPS)


def test_md1_queue_matches_its_formula():
    """Poisson arrivals, deterministic service: mean wait Wq = rho / (2 mu (1 - rho))."""
    rng = random.Random(11)
    service_ms, rho = 10.0, 0.7
    mean_gap_ms = service_ms / rho
    sim = Simulator()
    state = {"busy_until": 0.0, "waits": []}

    def arrive(s, _):
        start = max(s.now_ms, state["busy_until"])
        state["waits"].append(start - s.now_ms)
        state["busy_until"] = start + service_ms
        if len(state["waits"]) < 200_000:
            return [(s.now_ms + rng.expovariate(1.0 / mean_gap_ms), arrive, None)]
        return None

    sim.schedule(0.0, arrive)
    sim.run()
    waits = state["waits"][1000:]
    mu = 1.0 / service_ms
    expected = rho / (2 * mu * (1 - rho))  # 11.67 ms
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.04)
