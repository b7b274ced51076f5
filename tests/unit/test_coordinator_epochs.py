"""The coordinator's epoch loop outlives a failing epoch, and a static layout waits for a node that can hold it.

At boot the coordinator can run an epoch when only some workers of a node have registered: a static policy then
sees a one-device node, on which TP2 is not an allowed level. That epoch used to raise out of the loop, which
ended every later epoch (the layout was never restored; CI caught it as `nitsum bench policy --live` never
reaching its shape)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from nitsum.policy.registry import make_policy
from nitsum.policy.snapshot import ClusterSnapshot, GroupView, NodeView
from nitsum_services.coordinator.core import Coordinator


def _node(n: int, max_tp: int, tp: int = 1) -> NodeView:
    groups = tuple(GroupView(f"node0-g{s}-tp{tp}", tuple(range(s, s + tp)), tp, "hybrid") for s in range(0, n, tp))
    return NodeView("node0", n, 1, max_tp, groups, "cpu")


@pytest.mark.parametrize("spec", ["static-tp:2", "static-tp:4"])
def test_a_static_policy_on_a_node_too_small_for_it_waits_instead_of_raising(spec):
    policy = make_policy(spec)
    [d] = policy.decide_topology(ClusterSnapshot(0.0, (_node(1, 1),)))  # one of four workers known so far
    assert d.target is None and "cannot lay out now" in d.reason
    [d] = policy.decide_topology(ClusterSnapshot(0.0, (_node(4, 4),)))  # all four: the layout is restored
    assert d.target is not None and str(d.target) == str(policy.initial_topology(_node(4, 4)))


def _epoch_loop_host(reconfig_interval_ms: int, policy_spec: str) -> SimpleNamespace:
    """What `Coordinator.epochs` reads of its coordinator (one known worker); the test sets `run_epoch`."""
    return SimpleNamespace(
        config=SimpleNamespace(reconfig_interval_ms=reconfig_interval_ms),
        ctx=SimpleNamespace(stop=asyncio.Event()),
        trigger=asyncio.Event(),
        members=SimpleNamespace(workers={"node0-0": object()}),
        policy_spec=policy_spec,
        epoch_problem="",
        last_decisions=[],
    )


def test_the_epoch_loop_goes_on_after_an_epoch_raises(caplog):
    async def scenario():
        calls = []
        fake = _epoch_loop_host(reconfig_interval_ms=1, policy_spec="static-tp:2")

        async def run_epoch():
            calls.append(len(calls))
            if len(calls) <= 3:
                raise ValueError("static-tp:2: TP2 is not an allowed level on node node0 (allowed: 1)")
            fake.last_decisions = [{"node_id": "node0", "target": "[0-1 TP2 hybrid][2-3 TP2 hybrid]"}]
            fake.ctx.stop.set()

        fake.run_epoch = run_epoch
        await asyncio.wait_for(Coordinator.epochs(fake), 10.0)
        return calls, fake

    with caplog.at_level(logging.ERROR, logger="nitsum.coordinator"):
        calls, fake = asyncio.run(scenario())
    assert len(calls) == 4  # three failed epochs, then one that decides
    assert fake.epoch_problem == "" and fake.last_decisions[0]["target"].startswith("[0-1 TP2")
    failures = [r for r in caplog.records if "epoch failed" in r.getMessage()]
    assert len(failures) == 1  # the same problem is logged once, not every epoch


def test_queue_events_run_an_epoch_at_most_every_event_gap():
    # Under load nearly every interactive submission sets the trigger; the epochs it starts must not run back
    # to back (they did: one per request at 400 req/s). The periodic epoch is far away (10 s) here.
    from nitsum_services.coordinator.core import EVENT_EPOCH_GAP_S

    async def scenario():
        starts = []
        fake = _epoch_loop_host(reconfig_interval_ms=10_000, policy_spec="adaptive")

        async def run_epoch():
            starts.append(asyncio.get_running_loop().time())
            if len(starts) == 5:
                fake.ctx.stop.set()

        async def submissions():
            while not fake.ctx.stop.is_set():
                fake.trigger.set()  # a queue event at every loop turn
                await asyncio.sleep(0)

        fake.run_epoch = run_epoch
        feeder = asyncio.ensure_future(submissions())
        await asyncio.wait_for(Coordinator.epochs(fake), 10.0)
        await feeder
        return starts

    starts = asyncio.run(scenario())
    assert len(starts) == 5  # queue events still start epochs long before the 10 s period
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= EVENT_EPOCH_GAP_S * 0.99, gaps


def _members(*devices: int, node_size: int = 4):
    from nitsum.wire.messages import WorkerStats
    from nitsum_services.coordinator.membership import Membership

    members = Membership(60.0)
    for d in devices:
        members.on_stats(
            WorkerStats(
                f"node0-{d}",
                "node0",
                d,
                "cpu",
                "hybrid",
                "ready",
                f"node0-g{d}-tp1",
                1,
                "tiny",
                2048,
                0,
                0,
                10,
                10,
                instance_id="a",
                in_world=True,
                leader=True,
                node_size=node_size,
            ),
            0.0,
        )
    return members


def test_nodes_are_judged_at_their_full_size_not_by_who_registered_yet():
    config = SimpleNamespace(max_tp=4, min_tp=1, device_kind="cpu")
    fake = SimpleNamespace(members=_members(0, 2), config=config)  # workers 1 and 3 restarting / not up yet
    [node] = Coordinator.full_nodes(fake)
    assert (node.node_id, node.num_devices, node.max_tp) == ("node0", 4, 4)
    fake = SimpleNamespace(members=_members(0, 1, 2, node_size=6), config=config)
    [node] = Coordinator.full_nodes(fake)
    assert (node.num_devices, node.max_tp) == (6, 2)  # TP4 groups cannot tile six devices
    standalone = SimpleNamespace(members=_members(0, node_size=0), config=config)
    assert [n.num_devices for n in Coordinator.full_nodes(standalone)] == [1]


def test_a_layout_a_full_node_cannot_hold_is_warned_about_once(caplog):
    fake = SimpleNamespace(
        members=_members(0, 1, 2, 3),
        config=SimpleNamespace(max_tp=4, min_tp=1, device_kind="cpu"),
        policy=make_policy("static-tp:8"),
        policy_spec="static-tp:8",
        unfit_warned=set(),
    )
    fake.full_nodes = lambda: Coordinator.full_nodes(fake)
    with caplog.at_level(logging.WARNING, logger="nitsum.coordinator"):
        for _ in range(3):
            Coordinator.warn_unfit_layouts(fake)
    warned = [r.getMessage() for r in caplog.records if "cannot lay out node node0" in r.getMessage()]
    assert len(warned) == 1 and "static-tp:8" in warned[0]
    fake.policy, fake.policy_spec = make_policy("static-tp:2"), "static-tp:2"
    Coordinator.warn_unfit_layouts(fake)
    assert fake.unfit_warned == {("node0", "static-tp:8")}


def test_set_policy_refuses_a_layout_the_nodes_cannot_hold():
    fake = SimpleNamespace(
        config=SimpleNamespace(),
        pinned_nodes=set(),
        policy=None,
        policy_spec="adaptive",
        full_nodes=lambda: [_node(2, 2)],
    )
    import nitsum_services.coordinator.core as core

    real = core.policy_config
    core.policy_config = lambda config: None
    try:
        problem = Coordinator.set_policy(fake, "static-tp:4")
        assert "does not fit node node0 (2 devices)" in problem and fake.policy_spec == "adaptive"
        assert Coordinator.set_policy(fake, "static-tp:2") == "" and fake.policy_spec == "static-tp:2"
    finally:
        core.policy_config = real


def test_up_refuses_a_policy_that_does_not_fit_its_devices(capsys):
    from nitsum.up import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--devices", "4", "--policy", "static-tp:8"])
    assert "--policy: static-tp:8" in capsys.readouterr().err
    assert parse_args(["--devices", "4", "--policy", "static-tp:4"]).policy == "static-tp:4"
