"""The coordinator's side of roles inside node worlds, without a mesh: the transition agent reads each group's
role from its leader's heartbeat and treats a role change as a change (sent through Prepare/Commit with the
roles); a fresh request goes to a node-world prefill group with the least loaded decode leader of the same
world to hand off to (a hybrid one when the world has no decode group); everything else runs where it is."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from nitsum.topology import Topology
from nitsum.wire.messages import SamplingSpec, SubmitRequest, TopologyAck, TopologyPrepare, WorkerStats
from nitsum_services.coordinator.core import pd_plan
from nitsum_services.coordinator.membership import Membership
from nitsum_services.coordinator.transition import TransitionAgent


def _stats(device: int, tp: int, role: str, node: str = "node0", generation: int = 1) -> WorkerStats:
    start = device - device % tp
    return WorkerStats(
        f"{node}-{device}",
        node,
        device,
        "cpu",
        role,
        "ready",
        f"{node}-g{start}-tp{tp}",
        tp,
        "tiny",
        2048,
        0,
        0,
        10,
        10,
        instance_id="a",
        in_world=True,
        leader=device == start,
        node_size=4,
        generation=generation,
    )


def _coordinator(*stats: WorkerStats):
    sent: list = []

    class _Bus:
        subjects = SimpleNamespace(worker_control=lambda w: f"control.{w}")

        async def request(self, subject, message, timeout_s, expected):
            sent.append((subject, message))
            return TopologyAck(subject.split(".")[1], message.epoch, True, "x")

    class _Span:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_attribute(self, *a):
            pass

    metrics = SimpleNamespace(
        reconfiguration_duration_ms=lambda: SimpleNamespace(labels=lambda **k: SimpleNamespace(observe=lambda v: None))
    )
    c = SimpleNamespace(
        members=Membership(60.0),
        config=SimpleNamespace(min_tp=1, max_tp=4),
        bus=_Bus(),
        ctx=SimpleNamespace(metrics=metrics, tracer=SimpleNamespace(start_as_current_span=lambda *a, **k: _Span())),
        last_reconfig_ms={},
        now_ms=lambda: 0.0,
    )
    for s in stats:
        c.members.on_stats(s, 0.0)
    c.transitions = TransitionAgent(c)
    return c, sent


DISAGG = (_stats(0, 2, "prefill"), _stats(1, 2, "prefill"), _stats(2, 2, "decode"), _stats(3, 2, "decode"))


def test_the_current_topology_carries_the_roles_the_leaders_report():
    c, _ = _coordinator(*DISAGG)
    assert str(c.transitions.current("node0")) == "[0-1 TP2 prefill][2-3 TP2 decode]"


def test_a_role_only_change_is_one_transition_that_tells_every_leader_the_roles():
    c, sent = _coordinator(*DISAGG)
    target = Topology.parse("[0-1 TP2 hybrid][2-3 TP2 decode]")
    report = asyncio.run(c.transitions.apply("node0", target, "test"))
    assert report["changed"] and report["topology"] == str(target)
    prepares = [m for _, m in sent if isinstance(m, TopologyPrepare)]
    assert sorted(s for s, m in sent if isinstance(m, TopologyPrepare)) == ["control.node0-0", "control.node0-2"]
    assert all([(g.start, g.tp, g.role) for g in m.groups] == [(0, 2, "hybrid"), (2, 2, "decode")] for m in prepares)
    assert [g.worker_ids for g in prepares[0].groups] == [("node0-0", "node0-1"), ("node0-2", "node0-3")]
    # Until fresh heartbeats, the coordinator's view is the committed one, roles included.
    assert str(c.transitions.current("node0")) == str(target)
    # The same layout again is no change.
    sent.clear()
    assert asyncio.run(c.transitions.apply("node0", target, "test"))["changed"] is False and not sent


def _request(attempt: int = 0, max_tokens: int = 8) -> SubmitRequest:
    return SubmitRequest(
        "r", (1, 2, 3), SamplingSpec(max_tokens=max_tokens), "interactive", 1e3, 1e2, 1.0, 0.0, "s", attempt=attempt
    )


def test_a_fresh_request_is_prefilled_by_a_world_prefill_group_for_a_decode_leader_of_its_world():
    c, _ = _coordinator(*DISAGG)
    leaders = [c.members.workers[w] for w in ("node0-0", "node0-2")]
    plan = [(r.worker_id, d) for r, d in pd_plan(_request(), leaders, None)]
    assert plan == [("node0-0", "node0-2"), ("node0-2", "")]
    # Re-submitted, or with one token to generate: it runs where it is computed, never on a prefill group.
    assert [(r.worker_id, d) for r, d in pd_plan(_request(attempt=1), leaders, None)] == [("node0-2", "")]
    assert [(r.worker_id, d) for r, d in pd_plan(_request(max_tokens=1), leaders, None)] == [("node0-2", "")]


def test_a_world_without_a_decode_group_hands_off_to_a_hybrid_one_of_the_same_generation():
    hybrid = _stats(2, 2, "hybrid")
    stale = dataclasses.replace(_stats(0, 1, "hybrid", node="node0"), generation=0)
    c, _ = _coordinator(_stats(0, 2, "prefill"), hybrid)
    leaders = [c.members.workers[w] for w in ("node0-0", "node0-2")]
    assert [(r.worker_id, d) for r, d in pd_plan(_request(), leaders, None)] == [
        ("node0-0", "node0-2"),
        ("node0-2", ""),
    ]
    c, _ = _coordinator(_stats(0, 2, "prefill"), dataclasses.replace(stale, device_index=2, worker_id="node0-2"))
    leaders = [c.members.workers[w] for w in ("node0-0", "node0-2")]
    assert [(r.worker_id, d) for r, d in pd_plan(_request(), leaders, None)] == [("node0-2", "")]


def test_a_world_tp1_prefill_group_without_a_decoding_group_pairs_with_a_standalone_worker_of_another_node():
    standalone = dataclasses.replace(_stats(0, 1, "decode", node="nodeB"), in_world=False, node_size=1)
    c, _ = _coordinator(_stats(0, 1, "prefill"), _stats(1, 1, "prefill"), standalone)
    records = [c.members.workers[w] for w in ("node0-0", "node0-1", "nodeB-0")]
    assert [(r.worker_id, d) for r, d in pd_plan(_request(), records, None)] == [
        ("node0-0", "nodeB-0"),
        ("node0-1", "nodeB-0"),
        ("nodeB-0", ""),
    ]
    # A TP2 prefill group's heads are spread over its members: it hands off only inside its world.
    c, _ = _coordinator(_stats(0, 2, "prefill"), standalone)
    records = [c.members.workers[w] for w in ("node0-0", "nodeB-0")]
    assert [(r.worker_id, d) for r, d in pd_plan(_request(), records, None)] == [("nodeB-0", "")]


def test_a_world_tp2_group_on_shm_arenas_pairs_across_hosts_both_as_prefill_and_as_decode():
    """A TP2 group's leader that gathers its members' heads (kv_gather) is a one-cache end for the KV mover."""
    gather = lambda s: dataclasses.replace(s, kv_gather=True)  # noqa: E731
    standalone = dataclasses.replace(_stats(0, 1, "decode", node="nodeB"), in_world=False, node_size=1)
    c, _ = _coordinator(gather(_stats(0, 2, "prefill")), standalone)
    records = [c.members.workers[w] for w in ("node0-0", "nodeB-0")]
    assert [(r.worker_id, d) for r, d in pd_plan(_request(), records, None)] == [
        ("node0-0", "nodeB-0"),
        ("nodeB-0", ""),
    ]
    # the decode end a TP2 group of another host's world: only where it can scatter the heads as well
    for flag, want in ((True, [("node0-0", "nodeB-0"), ("nodeB-0", "")]), (False, [("nodeB-0", "")])):
        decode = dataclasses.replace(_stats(0, 2, "decode", node="nodeB"), kv_gather=flag)
        c, _ = _coordinator(gather(_stats(0, 2, "prefill")), decode)
        records = [c.members.workers[w] for w in ("node0-0", "nodeB-0")]
        assert [(r.worker_id, d) for r, d in pd_plan(_request(), records, None)] == want
