"""Re-formation of a node world, the pieces that need no world: the coordinator's decision when a node can be
re-formed (and why not), the worker's refusals, a standby worker's boot on the shared weights, the wire
message, the admin verb and the rendezvous ports of generations."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from nitsum.wire.codec import decode, encode
from nitsum.wire.messages import NodeReform, WorkerStats
from nitsum_services.coordinator.membership import Membership
from nitsum_services.coordinator.reform import ReformAgent, ReformError
from nitsum_services.coordinator.transition import TransitionAgent


def _stats(device: int, in_world=True, tp=1, state="ready", node_size=4, generation=0, node="node0") -> WorkerStats:
    start = device - device % tp
    return WorkerStats(
        f"{node}-{device}",
        node,
        device,
        "cpu",
        "hybrid",
        state,
        f"{node}-g{start}-tp{tp}",
        tp,
        "tiny",
        2048,
        0,
        0,
        10,
        10,
        instance_id="a",
        in_world=in_world,
        leader=device == start,
        node_size=node_size,
        generation=generation,
    )


def _agent(*stats: WorkerStats) -> ReformAgent:
    coordinator = SimpleNamespace(members=Membership(60.0))
    coordinator.transitions = TransitionAgent(coordinator)
    for s in stats:
        coordinator.members.on_stats(s, 0.0)
    return ReformAgent(coordinator)


def _refused(agent: ReformAgent, node: str = "node0", now_s: float = 0.5) -> str:
    with pytest.raises(ReformError) as err:
        agent.check(node, now_s=now_s)
    return str(err.value)


def test_a_node_with_every_device_back_at_tp1_and_one_outside_its_world_is_reformed():
    agent = _agent(_stats(0, in_world=False), _stats(1), _stats(2), _stats(3))
    assert agent.nodes() == ["node0"] and agent.needed("node0")
    assert [r.stats.device_index for r in agent.check("node0", now_s=0.5)] == [0, 1, 2, 3]


def test_why_a_node_cannot_be_reformed():
    assert "missing workers: have devices [0, 1, 3]" in _refused(
        _agent(_stats(0, in_world=False), _stats(1), _stats(3))
    )
    # The last device gone: the node's size (from the heartbeats) still says who is missing.
    assert "needs 0..3" in _refused(_agent(_stats(0, in_world=False), _stats(1), _stats(2)))
    assert "not ready" in _refused(_agent(_stats(0, in_world=False, state="draining"), _stats(1), _stats(2), _stats(3)))
    nothing = _refused(_agent(*(_stats(d, generation=2) for d in range(4))))
    assert "nothing to re-form" in nothing and "generation 2" in nothing
    # A TP>1 group with a member outside the world cannot be split (its communicator has no use now).
    blocked = _refused(
        _agent(_stats(0, tp=2, in_world=True), _stats(1, tp=2, in_world=False), _stats(2, in_world=False), _stats(3))
    )
    assert "node0-g0-tp2 (TP=2)" in blocked and "members outside the world" in blocked
    assert "standalone" in _refused(_agent(*(_stats(d, in_world=False, node_size=0) for d in range(2))))
    assert "no worker of node 'node9'" in _refused(_agent(_stats(0)), "node9")
    assert "disagree" in _refused(_agent(_stats(0, in_world=False), _stats(1, node_size=2)))


def test_a_tp2_group_still_whole_in_the_world_is_accepted_to_be_split_first():
    agent = _agent(_stats(0, tp=2), _stats(1, tp=2), _stats(2), _stats(3, in_world=False))
    assert [r.stats.tp for r in agent.check("node0", now_s=0.5)] == [2, 2, 1, 1]


def test_a_worker_not_heard_from_just_now_holds_the_reformation_back():
    agent = _agent(_stats(0, in_world=False), _stats(1), _stats(2), _stats(3))
    agent.c.members.on_stats(_stats(0, in_world=False), 2.0)
    agent.c.members.on_stats(_stats(1), 2.0)
    agent.c.members.on_stats(_stats(2), 2.0)
    assert "['node0-3'] of node node0 have not reported" in _refused(agent, now_s=2.1)
    agent.c.members.on_stats(_stats(3), 2.0)
    assert len(agent.check("node0", now_s=2.1)) == 4


def test_a_group_whose_members_disagree_waits_for_them_to_settle():
    # Device 3 died at TP2; its last report still says TP2 while device 2 already fell back to TP=1.
    agent = _agent(_stats(0), _stats(1), _stats(2, in_world=False), _stats(3, tp=2))
    assert "disagree on their group" in _refused(agent)


def test_standalone_meshes_never_need_a_reformation():
    agent = _agent(*(_stats(d, in_world=False, node_size=0) for d in range(2)))
    assert agent.nodes() == [] and not agent.needed("node0")


def test_a_running_transition_holds_the_reformation_back():
    agent = _agent(_stats(0, in_world=False), _stats(1), _stats(2), _stats(3))

    async def go():
        async with agent.c.transitions.lock:
            return _refused(agent)

    assert "running" in asyncio.run(go())
    assert len(agent.check("node0", now_s=0.5)) == 4  # once it is done


def test_node_reform_stream_offset_and_the_new_heartbeat_fields_round_trip():
    from nitsum.wire.messages import StreamOffset

    msg = NodeReform("node0", 3, 4)
    assert decode(encode(msg)) == msg
    assert decode(encode(StreamOffset("cmpl-1", 6))) == StreamOffset("cmpl-1", 6)
    stats = _stats(2, node_size=4, generation=5)
    back = decode(encode(stats))
    assert back.node_size == 4 and back.generation == 5 and back == stats


def test_generations_meet_at_ports_above_the_base_in_a_small_range():
    from nitsum.parallel.world import PORT_SPAN, rendezvous_port

    assert [rendezvous_port(29400, g) for g in (0, 1, 2, PORT_SPAN - 1, PORT_SPAN, PORT_SPAN + 3)] == [
        29400,
        29401,
        29402,
        29400 + PORT_SPAN - 1,
        29400,
        29403,
    ]
    with pytest.raises(ValueError, match="NITSUM_NODE_MASTER_PORT must be at most"):
        rendezvous_port(65530, 7)


def test_up_picks_a_master_port_with_its_generation_span_free():
    import socket

    from nitsum.config import NODE_PORT_SPAN
    from nitsum.up import _free_port_span

    base = _free_port_span()
    for port in range(base, base + NODE_PORT_SPAN):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if taken


def test_admin_verb_reform_node():
    from nitsum.admin import build_parser
    from nitsum.wire.subjects import Subjects

    args = build_parser().parse_args(["reform-node", "--node", "node1"])
    assert args.command == "reform-node" and args.node == "node1" and args.timeout is None
    assert Subjects().admin("reform-node") == "nitsum.admin.reform-node"


@pytest.fixture()
def standby(tiny_model_dir):
    """A worker restarted in standby (NITSUM_NODE_STANDBY=1) of a 4-device node, built as the worker does."""
    from nitsum.config import WorkerConfig, load
    from nitsum.parallel.weights import DEFAULT_SHM_DIR, store_key
    from nitsum_services.worker.boot import build_backend

    env = {
        "NITSUM_MODEL": str(tiny_model_dir),
        "NITSUM_NODE_SIZE": "4",
        "NITSUM_NODE_STANDBY": "1",
        "NITSUM_DEVICE_INDEX": "2",
        "NITSUM_KV_CACHE_MB": "4",
    }
    config = load(WorkerConfig, [], env)
    base = Path(DEFAULT_SHM_DIR) / store_key(Path(tiny_model_dir).resolve(), "float32")
    try:
        yield config, build_backend(config, "hybrid")
    finally:
        for suffix in (".json", ".bin", ".lock"):
            base.with_suffix(suffix).unlink(missing_ok=True)


def test_a_standby_worker_serves_tp1_on_views_of_the_shared_store(standby):
    from nitsum_services.worker.backend import StandbyBackend

    _config, backend = standby
    assert isinstance(backend, StandbyBackend) and backend.in_world is False and backend.group == (2, 1)
    assert backend.generation == 0 and backend.engine.cfg.role == "hybrid"
    # Its parameters are views of the store's one mapping (the weights a later NodeRuntime cuts from), not copies.
    mapping = {t.untyped_storage().data_ptr() for t in backend.weights.values()}
    assert len(mapping) == 1
    assert {p.untyped_storage().data_ptr() for p in backend.engine.runner.model.parameters()} == mapping


def test_what_a_worker_refuses_to_reform(standby):
    from nitsum_services.worker.peer_loss import reform_refusal

    config, backend = standby

    def why(msg, busy=False, node_id="node0", node_size=4):
        return reform_refusal(backend, node_id, node_size, msg, busy)

    assert why(NodeReform("node0", 1, 4)) == ""
    assert "belongs to node 'node0', not 'node1'" in why(NodeReform("node1", 1, 4))
    assert "not part of a node world" in why(NodeReform("node0", 1, 4), node_size=0)
    assert "has 4 workers" in why(NodeReform("node0", 1, 2))
    assert "already running" in why(NodeReform("node0", 1, 4), busy=True)
    assert "not newer" in why(NodeReform("node0", 0, 4))


def test_leaving_the_process_world_resets_torch_group_names():
    """A rendezvous that failed inside init_process_group advanced torch's group counter; members that disagree on
    it wait for each other's keys forever. Each generation starts from 0."""
    import torch.distributed as dist

    from nitsum.parallel.world import leave_process_world

    assert not dist.is_initialized()
    dist.distributed_c10d._world.group_count = 3
    leave_process_world()
    assert dist.distributed_c10d._world.group_count == 0


def test_a_group_that_lost_its_world_takes_only_a_change_inside_itself():
    from nitsum.topology import Group, Topology
    from nitsum_services.worker.peer_loss import local_change

    # What group 0-1 last knew (the failed merge never committed) vs the coordinator's view now (2 fell back).
    mine = Topology.of(4, [(0, 2), (2, 2)])
    own = Group(0, 2)
    # The split the coordinator asks for: kept inside 0-1, the rest as this worker knows it (span = 0-1).
    assert local_change(mine, own, ((0, 1), (1, 1), (2, 1), (3, 1))) == ((0, 1), (1, 1), (2, 2))
    assert local_change(mine, own, ((0, 2), (2, 1), (3, 1))) == ((0, 2), (2, 2))  # no change inside: a no-op
    assert local_change(mine, own, ((0, 4),)) is None  # a merge reaches outside the group
    assert local_change(Topology.of(4, [(0, 4)]), Group(0, 4), ((0, 2), (2, 1), (3, 1))) == ((0, 2), (2, 1), (3, 1))
    assert local_change(Topology.uniform(4, 1), Group(1, 1), ((0, 1), (1, 1), (2, 1), (3, 1))) is None  # TP=1


def test_a_master_port_without_room_for_the_generations_is_refused():
    from nitsum.config import ConfigError, WorkerConfig, load

    assert load(WorkerConfig, [], {"NITSUM_NODE_MASTER_PORT": "65520"}).node_master_port == 65520
    with pytest.raises(ConfigError, match="NITSUM_NODE_MASTER_PORT.*at most 65520"):
        load(WorkerConfig, [], {"NITSUM_NODE_MASTER_PORT": "65530"})
