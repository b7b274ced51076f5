"""The worker's transfer agent against a real nats-server: permits from the flow-scheduler (batched), the
lowest level when it is silent, strict priority among waiting flows, promotions, completions."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import replace

from nitsum.bus import Bus
from nitsum.config import CommonConfig, FlowSchedulerConfig
from nitsum.service import ServiceContext
from nitsum.telemetry.metrics import Metrics
from nitsum.wire.codec import decode
from nitsum.wire.messages import FlowCompletion, FlowPermit, FlowSubmit
from nitsum_services.flow_scheduler.main import FlowService, body
from nitsum_services.worker.transfer import TransferAgent


def _flow(flow_id: str, stage: str = "3", layer: int = 0) -> FlowSubmit:
    return FlowSubmit(flow_id, "r1", "r1", stage, 4096, "w0", "w1", target_layer=layer, deadline_unix_ms=1e15)


async def test_silent_flow_scheduler_means_lowest_level_and_the_flow_still_goes(nats_server):
    bus = await Bus.connect(CommonConfig(nats_url=nats_server.url), "w0")
    metrics = Metrics("w0")
    try:
        agent = TransferAgent(bus, "w0", metrics, permit_timeout_s=0.2)
        await agent.start()
        permits = await agent.permits([_flow("a"), _flow("b", layer=1)])
        assert [(p.flow_id, p.level, p.dscp) for p in permits] == [("a", 8, 1), ("b", 8, 1)]
        assert agent.num_fallbacks == 2
        assert "nitsum_flow_fallbacks_total 2.0" in metrics.render()[0].decode()

        async def send(level: int) -> int:
            assert level == 8
            return 4096

        assert await agent.run("a", permits[0], send) == 4096
    finally:
        await bus.drain()


async def test_strict_priority_promotions_and_completions(nats_server):
    bus = await Bus.connect(CommonConfig(nats_url=nats_server.url), "w0")
    peer = await Bus.connect(CommonConfig(nats_url=nats_server.url), "fs")
    done: list[FlowCompletion] = []

    async def on_done(msg) -> None:
        done.append(decode(msg.data, FlowCompletion))

    sub = await peer.nc.subscribe("nitsum.flow.done", cb=on_done)
    try:
        agent = TransferAgent(bus, "w0", Metrics("w0"), max_in_flight=1)
        await agent.start()
        gate = asyncio.Event()

        async def blocked(_level: int) -> int:
            await gate.wait()
            return 1

        async def quick(_level: int) -> int:
            return 2

        first = asyncio.create_task(agent.run("busy", FlowPermit("busy", 5, 0), blocked))
        await asyncio.sleep(0.05)
        waiting = [
            asyncio.create_task(agent.run(fid, FlowPermit(fid, level, 0), quick))
            for fid, level in (("p5", 5), ("p2a", 2), ("p7", 7), ("p2b", 2))
        ]
        await asyncio.sleep(0.05)
        assert len(agent.queue) == 4
        # the flow-scheduler promotes p7 to P1 while it waits; a demotion of p2b is ignored
        await peer.publish("nitsum.flow.permit.w0", FlowPermit("p7", 1, 46))
        await peer.publish("nitsum.flow.permit.w0", FlowPermit("p2b", 6, 0))
        await peer.flush()
        await asyncio.sleep(0.1)
        assert agent.num_promotions == 1
        gate.set()
        await asyncio.gather(first, *waiting)
        assert agent.sent_order == ["busy", "p7", "p2a", "p2b", "p5"]
        await asyncio.sleep(0.1)
        assert sorted((c.flow_id, c.ok, c.bytes_sent) for c in done) == [
            ("busy", True, 1),
            ("p2a", True, 2),
            ("p2b", True, 2),
            ("p5", True, 2),
            ("p7", True, 2),
        ]
        assert agent.in_flight == 0 and len(agent.queue) == 0
    finally:
        await sub.unsubscribe()
        await bus.drain()
        await peer.drain()


async def test_batched_permits_from_the_flow_scheduler_are_counted(nats_server):
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
    try:
        agent = TransferAgent(bus, "w0", Metrics("w0"))
        permits = await agent.permits([_flow(f"f{i}", stage="1" if i % 2 else "3", layer=i) for i in range(4)])
        assert [p.flow_id for p in permits] == ["f0", "f1", "f2", "f3"]
        assert agent.num_fallbacks == 0
        assert all(1 <= p.level <= 8 and not p.pruned for p in permits)
        # implicit (stage 1) flows never get P1; every permit carries its level's DSCP
        assert all(p.level >= 2 for p in permits[1::2])
        assert all(p.dscp == FlowService(ctx).dscp[p.level] for p in permits)
        text = ctx.metrics.render()[0].decode()
        assert "nitsum_flow_permits_total{level=" in text
        total = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("nitsum_flow_permits_total{")
        )
        assert total == 4
        bad = await agent.permits([FlowSubmit("x", "r", "r", "3", 1, "w0", "w1")])  # stage 3 without a deadline
        assert bad[0].pruned and "deadline" in bad[0].reason
    finally:
        ctx.stop.set()
        for hook in ctx.drain_hooks:
            await hook()
        await bus.drain()
        await fs_bus.drain()


async def test_a_pruned_permit_withdraws_waiting_flows_and_refuses_new_ones(nats_server):
    from nitsum_services.worker.transfer import FlowPrunedError

    bus = await Bus.connect(CommonConfig(nats_url=nats_server.url), "w0")
    peer = await Bus.connect(CommonConfig(nats_url=nats_server.url), "fs")
    try:
        agent = TransferAgent(bus, "w0", Metrics("w0"), max_in_flight=1)
        await agent.start()
        gate = asyncio.Event()
        sent: list[str] = []

        async def blocked(_level: int) -> int:
            await gate.wait()
            sent.append("busy")
            return 1

        def quick(fid: str):
            async def send(_level: int) -> int:
                sent.append(fid)
                return 2

            return send

        first = asyncio.create_task(agent.run("busy", FlowPermit("busy", 5, 0), blocked))
        await asyncio.sleep(0.05)
        keep = asyncio.create_task(agent.run("keep", FlowPermit("keep", 5, 0), quick("keep")))
        cut = asyncio.create_task(agent.run("cut", FlowPermit("cut", 3, 0), quick("cut")))
        await asyncio.sleep(0.05)
        # pushed while "cut" waits: it leaves the queue and never sends; "busy" (in flight) is not touched
        pruned = FlowPermit("cut", 8, 1, pruned=True, reason="overload", code="overload_pruned")
        await peer.publish("nitsum.flow.permit.w0", pruned)
        await peer.publish("nitsum.flow.permit.w0", replace(pruned, flow_id="busy"))
        await peer.flush()
        await asyncio.sleep(0.1)
        gate.set()
        assert await first == 1 and await keep == 2
        try:
            await cut
            raise AssertionError("a pruned flow was sent")
        except FlowPrunedError as exc:
            assert "overload" in str(exc)
        # a permit that comes back pruned at submit: the flow never waits for a turn
        try:
            await agent.run("late", replace(pruned, flow_id="late"), quick("late"))
            raise AssertionError("a flow refused at submit was sent")
        except FlowPrunedError:
            pass
        assert sent == ["busy", "keep"] and agent.num_pruned == 2
        assert len(agent.queue) == 0 and agent.in_flight == 0
    finally:
        await bus.drain()
        await peer.drain()
