"""The real flow-scheduler service over a real nats-server, fed the live inputs of issue #19: link capacities
per host NIC from configuration, layer progress from prefill workers (here published by the test: the
worker side is not wired yet), link load from the flows it permits, and overload pruning with a coded,
retryable answer."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import pytest

from nitsum.bus import Bus
from nitsum.config import CommonConfig, ConfigError, FlowSchedulerConfig, load
from nitsum.policy.flows import DSCP_TABLE
from nitsum.service import ServiceContext
from nitsum.telemetry.metrics import Metrics
from nitsum.wire.codec import decode
from nitsum.wire.messages import (
    FlowCompletion,
    FlowPermit,
    FlowPermitBatch,
    FlowProgress,
    FlowPruned,
    FlowSubmit,
    FlowSubmitBatch,
    LayerProgress,
)
from nitsum_services.flow_scheduler.main import PRUNED_CODE, body

GB = 1_000_000_000


class _Live:
    def __init__(self, url: str, **config) -> None:
        self.url = url
        self.config = FlowSchedulerConfig(nats_url=url, **config)

    async def __aenter__(self):
        self.fs_bus = await Bus.connect(CommonConfig(nats_url=self.url), "flow-scheduler")
        self.ctx = ServiceContext(
            "flow-scheduler", self.config, Metrics("flow-scheduler"), AsyncExitStack(), asyncio.Event(), bus=self.fs_bus
        )
        self.service_obj = await body(self.ctx)
        self.bus = await Bus.connect(CommonConfig(nats_url=self.url), "w0")
        self.permits: list[FlowPermit] = []
        self.pruned: list[FlowPruned] = []

        async def on_permit(msg) -> None:
            self.permits.append(decode(msg.data, FlowPermit))

        async def on_pruned(msg) -> None:
            self.pruned.append(decode(msg.data, FlowPruned))

        self.subs = [
            await self.bus.nc.subscribe("nitsum.flow.permit.w0", cb=on_permit),
            await self.bus.nc.subscribe("nitsum.flow.pruned", cb=on_pruned),
        ]
        await self.bus.flush()
        return self

    async def __aexit__(self, *exc):
        for s in self.subs:
            await s.unsubscribe()
        self.ctx.stop.set()
        for hook in self.ctx.drain_hooks:
            await hook()
        await self.bus.drain()
        await self.fs_bus.drain()

    async def submit(self, *flows: FlowSubmit) -> tuple[FlowPermit, ...]:
        reply = await self.bus.request(
            "nitsum.flow.submit", FlowSubmitBatch(tuple(flows)), 5.0, expected=FlowPermitBatch
        )
        return reply.permits

    @property
    def service(self):
        return self.ctx  # for symmetry in asserts below

    def service_scheduler(self):
        """The flow-scheduler service's own scheduler (its subscriptions hold the service)."""
        return self.service_obj.scheduler

    async def wait_for(self, pred, timeout_s: float = 3.0) -> None:
        end = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < end, "timed out"
            await asyncio.sleep(0.02)


def _now() -> float:
    return time.time() * 1000.0


def test_link_capacities_come_from_configuration():
    env = {"NITSUM_FLOW_LINK_GBPS": "host-a=200, host-b=25", "NITSUM_FLOW_DEFAULT_GBPS": "50"}
    cfg = load(FlowSchedulerConfig, [], environ=env)
    assert cfg.link_bandwidth_bps() == {"host-a": 200e9, "host-b": 25e9} and cfg.flow_default_gbps == 50.0
    with pytest.raises(ConfigError, match="host=Gb/s"):
        load(FlowSchedulerConfig, [], environ={"NITSUM_FLOW_LINK_GBPS": "host-a=fast"})


async def test_mlu_uses_the_configured_nic_of_each_host(nats_server):
    """The same stage-3 flow (1 GB, 1 s left): on a 200 Gb/s host pair its MLU is 0.04 (level 2), on a pair
    through a 25 Gb/s NIC it is 0.32, past Q_1 = 0.125 (P1)."""
    async with _Live(nats_server.url, flow_link_gbps=("fast=200", "fast2=200", "slow=25")) as live:
        dl = _now() + 1000.0
        fast, slow = await live.submit(
            FlowSubmit("f", "r1", "u1", "3", GB, "w0", "w1", deadline_unix_ms=dl, src_host="fast", dst_host="fast2"),
            FlowSubmit("s", "r2", "u2", "3", GB, "w0", "w1", deadline_unix_ms=dl, src_host="fast", dst_host="slow"),
        )
        assert (fast.level, fast.dscp) == (2, DSCP_TABLE[2])
        assert (slow.level, slow.dscp) == (1, DSCP_TABLE[1])


async def test_a_hosts_nic_speed_its_workers_report_is_its_links_capacity(nats_server):
    """Hosts NITSUM_FLOW_LINK_GBPS does not name: the NIC speed a flow carries (its workers read it from the
    kernel at boot) is the capacity instead of the 100 Gb/s default; a configured host keeps its own. The same
    1 GB / 1 s flow: 1000 Gb/s reported gives MLU 0.008 (level 3; the default would give 0.08, level 2); a
    25 Gb/s downlink 0.32 (P1); the configured 200 Gb/s pair reporting 25 stays at 0.04 (level 2)."""
    async with _Live(nats_server.url, flow_link_gbps=("fast=200", "fast2=200")) as live:
        dl = _now() + 1000.0

        def flow(fid: str, src: str, dst: str, src_gbps: float, dst_gbps: float) -> FlowSubmit:
            return FlowSubmit(
                fid,
                f"r-{fid}",
                f"u-{fid}",
                "3",
                GB,
                "w0",
                "w1",
                deadline_unix_ms=dl,
                src_host=src,
                dst_host=dst,
                src_link_gbps=src_gbps,
                dst_link_gbps=dst_gbps,
            )

        wide, narrow, configured, unknown = await live.submit(
            flow("a", "h1", "h2", 1000.0, 1000.0),
            flow("b", "h3", "h4", 1000.0, 25.0),
            flow("c", "fast", "fast2", 25.0, 25.0),
            flow("d", "h5", "h6", 0.0, -1.0),  # unknown: the default
        )
        assert (wide.level, narrow.level, configured.level, unknown.level) == (3, 1, 2, 2)


async def test_layer_progress_promotes_a_reuse_fetch_and_pushes_the_permit(nats_server):
    async with _Live(nats_server.url) as live:
        dl = _now() + 5000.0
        (p,) = await live.submit(
            FlowSubmit(
                "fetch",
                "r1",
                "u1",
                "1",
                1 << 20,
                "w0",
                "w1",
                target_layer=4,
                request_deadlines_unix_ms=(dl,),
                src_host="a",
                dst_host="b",
            )
        )
        assert p.level == 2 + 4  # RLI 4 before the unit's first layer
        for layer, level in ((1, 5), (3, 3), (4, 2)):
            await live.bus.publish(
                "nitsum.flow.progress", LayerProgress("u1", layer, (dl,), (FlowProgress("fetch", 1 << 19),))
            )
            await live.wait_for(lambda level=level: any(q.level == level for q in live.permits))
        assert [(q.flow_id, q.level, q.dscp) for q in live.permits] == [
            ("fetch", 5, DSCP_TABLE[5]),
            ("fetch", 3, DSCP_TABLE[3]),
            ("fetch", 2, DSCP_TABLE[2]),
        ]
        # a report of more bytes than the flow has left is ignored (never a demotion, never an error)
        await live.bus.publish("nitsum.flow.progress", LayerProgress("u1", 4, (), (FlowProgress("fetch", 1 << 30),)))
        await live.bus.flush()
        await asyncio.sleep(0.1)
        assert len(live.permits) == 3


async def test_link_load_from_permitted_flows_raises_the_mlu(nats_server):
    """A stage-3 flow whose MLU sits just under Q_1 alone; an all-to-all on the same uplink takes half of it
    (ρ = 1/2), which doubles the MLU at the next check: the flow is promoted to P1 and the agent told."""
    async with _Live(nats_server.url, flow_link_gbps=("a=100", "b=100", "c=100")) as live:
        dl = _now() + 1000.0
        size = int(0.1 * 100e9 / 8)  # MLU 0.1 with 1 s left at 100 Gb/s
        (p,) = await live.submit(
            FlowSubmit("kv", "r1", "u1", "3", size, "w0", "w1", deadline_unix_ms=dl, src_host="a", dst_host="b")
        )
        assert p.level == 2
        (c,) = await live.submit(
            FlowSubmit("a2a", "u2-a2a", "u2", "2", GB, "w0", "w2", target_layer=0, src_host="a", dst_host="c")
        )
        assert c.level == 2
        await live.wait_for(lambda: any(q.flow_id == "kv" and q.level == 1 for q in live.permits))


async def test_overload_pruning_answers_a_coded_retryable_message_and_refuses_later_flows(nats_server):
    """Two requests' stage-3 flows on one 10 Gb/s uplink, both due in 1 s, 1 GB each (0.8 s apiece): only one
    fits. The feasibility check prunes one; its agent gets a pruned permit, the gateways a FlowPruned with
    code overload_pruned, and a later flow of it is refused with the same code. The other goes on."""
    async with _Live(nats_server.url, flow_link_gbps=("a=10",)) as live:
        dl = _now() + 1000.0
        (p1,) = await live.submit(
            FlowSubmit(
                "k1",
                "r1",
                "u1",
                "3",
                GB,
                "w0",
                "w1",
                deadline_unix_ms=dl,
                request_deadlines_unix_ms=(dl,),
                src_host="a",
                dst_host="d1",
            )
        )
        assert not p1.pruned
        (p2,) = await live.submit(
            FlowSubmit(
                "k2",
                "r2",
                "u2",
                "3",
                GB,
                "w0",
                "w1",
                deadline_unix_ms=dl + 1,
                request_deadlines_unix_ms=(dl + 1,),
                src_host="a",
                dst_host="d2",
            )
        )
        await live.wait_for(lambda: live.pruned)
        (note,) = live.pruned
        assert note.code == PRUNED_CODE and note.retryable and note.reason
        victim = {"r1": "k1", "r2": "k2"}[note.request_id]
        assert note.flow_ids == (victim,)
        lowest = (8, DSCP_TABLE[8])  # a pruned flow's permit: the lowest class, never mistaken for a promotion
        answered = p2 if victim == "k2" else None
        if answered is not None:
            assert answered.pruned and answered.code == PRUNED_CODE  # the submit that caused it is answered so
            assert (answered.level, answered.dscp) == lowest
        else:
            await live.wait_for(lambda: any(q.flow_id == victim and q.pruned for q in live.permits))
            (q,) = [q for q in live.permits if q.flow_id == victim]
            assert (q.level, q.dscp, q.code) == (*lowest, PRUNED_CODE)
        (later,) = await live.submit(
            FlowSubmit(
                "k9", note.request_id, "u9", "3", 1, "w0", "w1", deadline_unix_ms=dl, src_host="a", dst_host="d1"
            )
        )
        assert later.pruned and later.code == PRUNED_CODE and (later.level, later.dscp) == lowest
        survivor = "k1" if victim == "k2" else "k2"
        await live.bus.publish("nitsum.flow.done", FlowCompletion(survivor, True, GB))
        await live.bus.flush()
        text = ""
        for _ in range(100):
            text = live.ctx.metrics.render()[0].decode()
            if 'nitsum_flow_bytes_total{stage="3"} 1e+09' in text:
                break
            await asyncio.sleep(0.02)
        assert 'nitsum_flow_bytes_total{stage="3"} 1e+09' in text
        assert 'nitsum_flow_pruned_total{stage="3"} 2.0' in text  # the victim's flow and the refused later one


async def test_a_batch_that_cannot_make_its_deadline_is_answered_pruned_in_its_own_reply(nats_server):
    """A prefix fetch submitted after its request's TTFT deadline: the check on its arrival prunes it, and the
    submit's own reply says so (lowest class, code overload_pruned); the gateways get the FlowPruned."""
    async with _Live(nats_server.url) as live:
        late = _now() - 100.0
        permits = await live.submit(
            *(
                FlowSubmit(
                    f"late.reuse.{layer}",
                    "late",
                    "late",
                    "1",
                    4096,
                    "w0",
                    "w1",
                    target_layer=layer,
                    deadline_unix_ms=late,
                    request_deadlines_unix_ms=(late,),
                )
                for layer in range(4)
            )
        )
        assert [(p.flow_id, p.pruned, p.code, p.level) for p in permits] == [
            (f"late.reuse.{layer}", True, PRUNED_CODE, 8) for layer in range(4)
        ]
        await live.wait_for(lambda: live.pruned)
        assert [(n.request_id, n.code, len(n.flow_ids)) for n in live.pruned] == [("late", PRUNED_CODE, 4)]
        # an on-time request next to it is permitted as usual
        (ok,) = await live.submit(
            FlowSubmit(
                "ok.reuse.0",
                "ok",
                "ok",
                "1",
                4096,
                "w0",
                "w1",
                target_layer=0,
                request_deadlines_unix_ms=(_now() + 5000.0,),
            )
        )
        assert not ok.pruned and ok.level == 2


async def test_flows_on_different_uplinks_do_not_queue_behind_each_other_in_the_check(nats_server):
    """The overload case above, but the two transfers leave through two hosts' NICs: both fit, none is pruned."""
    async with _Live(nats_server.url, flow_link_gbps=("a=10", "b=10")) as live:
        dl = _now() + 1000.0
        for i, host in ((1, "a"), (2, "b")):
            (p,) = await live.submit(
                FlowSubmit(
                    f"k{i}",
                    f"r{i}",
                    f"u{i}",
                    "3",
                    GB,
                    "w0",
                    "w1",
                    deadline_unix_ms=dl,
                    request_deadlines_unix_ms=(dl,),
                    src_host=host,
                    dst_host=f"d{i}",
                )
            )
            assert not p.pruned
        await asyncio.sleep(0.2)
        assert live.pruned == [] and not any(q.pruned for q in live.permits)
