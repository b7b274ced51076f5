"""A TP transition's pre-copy as stage-M flows, against a real nats-server: the old group leader's driver gets
permits from the real flow-scheduler (counted there, completions freeing them), runs every chunk in the real
worker session's step thread between iterations, and answers with the final prepare ack. Without a
flow-scheduler the same pre-copy runs at the lowest level: a transition never waits on it.

The node side is one leader's real `PreCopy` over small caches (two workers' worth of a node world would need
two processes; tests/e2e/test_adaptive_tp.py runs the whole thing on a live 4-worker mesh). With
`across_hosts` worker 1's new cache sits behind a real KV receiver on a real TCP link: the flow's bytes must
arrive on a connection in the class of the level its permit granted (the lowest level's without a permit)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from types import SimpleNamespace

import torch
from opentelemetry import trace

from nitsum.bus import Bus
from nitsum.config import CommonConfig, FlowSchedulerConfig
from nitsum.kv.reshard import Transfer
from nitsum.node.precopy import PreCopy, plan_flows, transfer_block_bytes
from nitsum.node.runtime import TransitionAck
from nitsum.policy.flows import DSCP_TABLE, tos_for_dscp
from nitsum.service import ServiceContext
from nitsum.telemetry.metrics import Metrics
from nitsum.transfer.kv_link import KvLinks
from nitsum.transfer.kv_receiver import KvReceiver
from nitsum.transfer.kv_tcp import LOWEST_DSCP
from nitsum.wire.messages import FlowPermit, FlowPermitBatch, FlowSubmitBatch, GroupAssignment, TopologyPrepare
from nitsum_services.flow_scheduler.main import body
from nitsum_services.worker.backend import NodeBackend
from nitsum_services.worker.migration_flows import MigrationDriver
from nitsum_services.worker.session import WorkerSession
from nitsum_services.worker.transfer import TransferAgent

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8
EPOCH = 7


class _LeaderRuntime:
    """What NodeBackend drives on an old group's leader (worker 0): the NodeRuntime calls it uses, over a
    real PreCopy; worker 1's new cache is just another tensor here (a mapped segment in a node world)."""

    def __init__(self, across_hosts: bool = False) -> None:
        shape = (LAYERS, 2, 8, BLOCK, HEADS, DIM)
        self.old = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        self.new = {0: torch.zeros(shape), 1: torch.zeros(shape)}
        transfers = [
            Transfer(0, 0, 0, LAYERS, 0, HEADS, (1,), (0,)),  # local
            Transfer(0, 1, 0, LAYERS, 0, HEADS, (2, 3, 4), (5, 6, 7)),
        ]
        per_block = transfer_block_bytes(transfers[1], BLOCK, DIM, 4)
        flows = plan_flows(transfers, lambda t: transfer_block_bytes(t, BLOCK, DIM, 4), chunk_bytes=per_block)
        self.receiver, self.links = None, None
        mapped = dict(self.new)
        if across_hosts:  # worker 1 on another host: its receiver writes what the link brings (as in prepare)
            self.receiver = KvReceiver("127.0.0.1")
            self.receiver.open(EPOCH, 1, mapped.pop(1), (0, HEADS), sources={0})
            self.links = KvLinks()
            self.links.connect(EPOCH, 0, {1: ("127.0.0.1", self.receiver.port, self.receiver.token)})
        self.pc = PreCopy(
            0,
            [0],
            transfers,
            flows,
            self.old,
            (0, HEADS),
            {w: (cache, (0, HEADS)) for w, cache in mapped.items()},
            self.links,
        )
        self.classes: list[dict[int, int]] = []  # the classes of each round, as the backend passed them
        self.final: TransitionAck | None = None
        self.is_leader, self.engine, self.epoch = True, None, 0
        self.rounds: list[list[tuple[int, int]]] = []

    @property
    def precopy_pending(self) -> bool:
        return not self.pc.complete

    def precopy_flows(self):
        return self.pc.flows

    def precopy_next_items(self, flows):
        return self.pc.next_items_of(flows)

    def precopy(self, items, classes=None):
        self.rounds.append(list(items))
        self.classes.append(dict(classes or {}))
        sent = self.pc.run(items, classes)
        if self.pc.complete:
            self.final = TransitionAck(EPOCH, True, "prepare", "", 1.0, self.pc.bytes_sent)
        return sent

    def poll_prepare(self, wait_s: float = 0.0) -> None:
        return None  # no runner build here: the final ack comes with the last chunk

    def take_prepare_ack(self):
        ack, self.final = self.final, None
        return ack

    def has_unfinished(self) -> bool:
        return False

    @property
    def group(self):
        return SimpleNamespace(start=0, tp=2)

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        if self.receiver is not None:
            self.receiver.close()


PREPARE = TopologyPrepare("node0", EPOCH, (GroupAssignment("node0-g0-tp2", 0, 2, "hybrid", ("w0", "w1")),))


async def _drive(
    nats_url: str, permit_timeout_s: float, across_hosts: bool = False
) -> tuple[TransitionAck, _LeaderRuntime, TransferAgent, Metrics]:
    bus = await Bus.connect(CommonConfig(nats_url=nats_url), "w0")
    metrics = Metrics("w0")
    runtime = _LeaderRuntime(across_hosts)
    session = WorkerSession(NodeBackend(runtime, "m", 64), bus, "w0", metrics, trace.get_tracer("test"))
    stop = asyncio.Event()
    loop_task = asyncio.create_task(session.run(stop))
    try:
        agent = TransferAgent(bus, "w0", metrics, permit_timeout_s=permit_timeout_s)
        await agent.start()
        driver = MigrationDriver(session, agent, "w0", metrics, budget_ms=2000.0)
        pending = TransitionAck(EPOCH, True, "prepare", "", 3.0, 0, pending=True)
        ack = await asyncio.wait_for(driver.drive(PREPARE, pending), 30)
        return ack, runtime, agent, metrics
    finally:
        stop.set()
        await asyncio.wait({loop_task}, timeout=5)
        await bus.drain()
        runtime.close()


def _check_copied(runtime: _LeaderRuntime) -> None:
    assert torch.equal(runtime.new[0][:, :, 0], runtime.old[:, :, 1])
    assert torch.equal(runtime.new[1][:, :, [5, 6, 7]], runtime.old[:, :, [2, 3, 4]])
    # All pairs moved together, one chunk each per step-thread iteration: three rounds for three blocks.
    assert [sorted(r) for r in runtime.rounds] == [[(0, 0), (1, 0)], [(1, 1)], [(1, 2)]]


async def test_precopy_flows_run_under_flow_scheduler_permits(nats_server):
    fs_bus = await Bus.connect(CommonConfig(nats_url=nats_server.url), "flow-scheduler")
    ctx = ServiceContext(
        "flow-scheduler",
        FlowSchedulerConfig(nats_url=nats_server.url),
        Metrics("flow-scheduler"),
        AsyncExitStack(),
        asyncio.Event(),
        bus=fs_bus,
    )
    await body(ctx)
    try:
        ack, runtime, agent, _ = await _drive(nats_server.url, permit_timeout_s=5.0)
        assert (ack.epoch, ack.ok, ack.pending, ack.phase) == (EPOCH, True, False, "prepare")
        per_block = LAYERS * 2 * BLOCK * HEADS * DIM * 4
        assert ack.bytes_moved == 3 * per_block  # the remote flow only; the local copy crosses no link
        _check_copied(runtime)
        assert agent.num_fallbacks == 0 and agent.sent_order == [f"tp-migration-node0-e{EPOCH}-w0-w1"]
        text = ctx.metrics.render()[0].decode()
        permits = [
            line for line in text.splitlines() if line.startswith("nitsum_flow_permits_total{") and 'stage="M"' in line
        ]
        assert len(permits) == 1 and permits[0].endswith(" 1.0")
        for _ in range(100):  # the completion frees the flow at the scheduler and counts its bytes
            text = ctx.metrics.render()[0].decode()
            if f'nitsum_flow_bytes_total{{stage="M"}} {float(3 * per_block)}' in text:
                break
            await asyncio.sleep(0.02)
        assert f'nitsum_flow_bytes_total{{stage="M"}} {float(3 * per_block)}' in text
    finally:
        ctx.stop.set()
        for hook in ctx.drain_hooks:
            await hook()
        await fs_bus.drain()


async def test_precopy_goes_on_without_a_flow_scheduler(nats_server):
    ack, runtime, agent, metrics = await _drive(nats_server.url, permit_timeout_s=0.2)
    assert (ack.ok, ack.pending) == (True, False)
    _check_copied(runtime)
    assert agent.num_fallbacks == 1
    text = metrics.render()[0].decode()
    assert "nitsum_flow_fallbacks_total 1.0" in text
    assert "nitsum_kv_migration_unpermitted_flows_total 1.0" in text


PERMIT_LEVEL = 3  # neither the delta's class (1) nor the lowest level's (8)


async def test_a_flow_across_hosts_goes_on_the_connection_of_its_permits_class(nats_server):
    """A flow-scheduler that grants level 3: the remote flow's bytes arrive on a connection whose handshake
    carried tos_for_dscp(DSCP of level 3); the pair's stage-M connection (opened in prepare) carried none."""
    fs_bus = await Bus.connect(CommonConfig(nats_url=nats_server.url), "flow-scheduler")

    async def grant(batch: FlowSubmitBatch, _delivery) -> FlowPermitBatch:
        return FlowPermitBatch(
            tuple(FlowPermit(f.flow_id, PERMIT_LEVEL, DSCP_TABLE[PERMIT_LEVEL]) for f in batch.flows)
        )

    await fs_bus.subscribe(fs_bus.subjects.flow_submit, grant, expected=FlowSubmitBatch)
    try:
        ack, runtime, agent, _ = await _drive(nats_server.url, permit_timeout_s=5.0, across_hosts=True)
    finally:
        await fs_bus.drain()
    assert (ack.ok, ack.pending) == (True, False) and agent.num_fallbacks == 0
    _check_copied(runtime)
    dscp = agent.dscp[PERMIT_LEVEL]
    assert dscp == DSCP_TABLE[PERMIT_LEVEL]
    assert runtime.classes == [{1: dscp}] * 3  # flow 1 is the remote pair; the local flow 0 has no class
    assert runtime.receiver.bytes_by_tos == {tos_for_dscp(dscp): ack.bytes_moved}
    assert runtime.receiver.errors == []


async def test_an_unpermitted_flow_across_hosts_goes_in_the_lowest_levels_class(nats_server):
    ack, runtime, agent, _ = await _drive(nats_server.url, permit_timeout_s=0.2, across_hosts=True)
    assert (ack.ok, ack.pending) == (True, False) and agent.num_fallbacks == 1
    _check_copied(runtime)
    assert agent.dscp[agent.num_levels] == LOWEST_DSCP
    assert runtime.classes == [{1: LOWEST_DSCP}] * 3
    assert runtime.receiver.bytes_by_tos == {tos_for_dscp(LOWEST_DSCP): ack.bytes_moved}


class _SteppingLeader(_LeaderRuntime):
    """The leader of an old group that keeps decoding: every step and pre-copy round is logged in order, and
    the prepare itself comes through the session's control path, as the coordinator's TopologyPrepare does."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.prepared = False

    def command(self, cmd):
        self.events.append(cmd.kind)
        if cmd.kind == "commit":
            return TransitionAck(EPOCH, True, "commit", "", 1.0)
        self.prepared = True
        return TransitionAck(EPOCH, True, "prepare", "", 3.0, 0, pending=True)

    @property
    def precopy_pending(self) -> bool:
        return self.prepared and not self.pc.complete

    def precopy(self, items, classes=None):
        self.events.append("round")
        return super().precopy(items, classes)

    def has_unfinished(self) -> bool:
        return True

    def step(self):
        self.events.append("step")
        import time as _time

        _time.sleep(0.005)
        return []

    def idle_tick(self) -> None:
        return None


async def test_the_first_precopy_round_runs_before_the_old_groups_next_step(nats_server, monkeypatch):
    """A prepare that comes back pending holds the old group's next step until its flows are permitted (a
    flow-scheduler round trip), so their first round runs before that step instead of one whole step later;
    the round that sends the final prepare ack holds the next step for the commit the same way. Each hold is
    bounded by a fraction of a steady step; here the bound is long, so the order is certain."""
    from nitsum.node.runtime import NodeCommand
    from nitsum_services.worker import holds as holds_module

    monkeypatch.setattr(holds_module, "PRECOPY_HOLD_MAX_S", 30.0)
    fs_bus = await Bus.connect(CommonConfig(nats_url=nats_server.url), "flow-scheduler")
    ctx = ServiceContext(
        "flow-scheduler",
        FlowSchedulerConfig(nats_url=nats_server.url),
        Metrics("flow-scheduler"),
        AsyncExitStack(),
        asyncio.Event(),
        bus=fs_bus,
    )
    await body(ctx)
    bus = await Bus.connect(CommonConfig(nats_url=nats_server.url), "w0")
    runtime = _SteppingLeader()
    metrics = Metrics("w0")
    session = WorkerSession(NodeBackend(runtime, "m", 64), bus, "w0", metrics, trace.get_tracer("test"))
    session.holds.recent_step_ms.extend([1000.0] * 16)  # a slow old group: the hold's bound is its cap (30 s here)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(session.run(stop))
    try:
        agent = TransferAgent(bus, "w0", metrics, permit_timeout_s=5.0)
        await agent.start()
        driver = MigrationDriver(session, agent, "w0", metrics, budget_ms=2000.0)
        pending = await asyncio.wait_for(session.control(NodeCommand("prepare", EPOCH, ((0, 2),))), 30)
        assert pending.pending
        ack = await asyncio.wait_for(driver.drive(PREPARE, pending), 30)
        assert (ack.ok, ack.pending) == (True, False)
        assert agent.num_fallbacks == 0  # the flow ran under its permit
        first = runtime.events.index("prepare")
        assert runtime.events[first + 1] == "round", runtime.events[: first + 5]  # not "step"
        _check_copied(runtime)
        # The last round sent the final prepare ack: the old group's next step waits (at most its hold) for the
        # commit, which then comes at that same step boundary, not after another step.
        commit = await asyncio.wait_for(session.control(NodeCommand("commit", EPOCH)), 30)
        assert (commit.phase, commit.ok) == ("commit", True)
        at = runtime.events.index("commit")
        assert runtime.events[at - 1] == "round" and runtime.events.count("round") == len(runtime.rounds), (
            runtime.events
        )
    finally:
        stop.set()
        await asyncio.wait({loop_task}, timeout=5)
        await bus.drain()
        runtime.close()
        ctx.stop.set()
        for hook in ctx.drain_hooks:
            await hook()
        await fs_bus.drain()
