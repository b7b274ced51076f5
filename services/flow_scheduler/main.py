"""`nitsum serve flow-scheduler`: the central half of Nuska.

Transfer agents submit flows (FlowSubmit → FlowPermit with the flow's current level and DSCP, or a
FlowSubmitBatch → FlowPermitBatch for every flow of one request) and report completions; every tick the
scheduler re-evaluates MLU/RLI, and each promotion is pushed to the source agent as a new FlowPermit.
Counters: `nitsum_flow_permits_total{stage,level}`, `nitsum_flow_bytes_total{stage}`,
`nitsum_flow_promotions_total{stage}`, `nitsum_flow_pruned_total{stage}` (flows refused a permit).
"""

from __future__ import annotations

import asyncio
import logging
import time

from nitsum.config import FlowSchedulerConfig
from nitsum.policy.flow_baselines import make_flow_scheduler
from nitsum.policy.flows import FlowSpec, RmlqConfig, RmlqScheduler, Stage, dscp_table
from nitsum.service import ServiceContext, run_service
from nitsum.wire.messages import FlowCompletion, FlowPermit, FlowPermitBatch, FlowSubmit, FlowSubmitBatch
from prometheus_client import Counter

log = logging.getLogger("nitsum.flow_scheduler")

TICK_S = 0.01


def _now_ms() -> float:
    return time.time() * 1000.0


class FlowService:
    def __init__(self, ctx: ServiceContext) -> None:
        config: FlowSchedulerConfig = ctx.config
        self.ctx = ctx
        if config.flow_policy == "rmlq":
            self.scheduler = RmlqScheduler(RmlqConfig(num_levels=config.flow_levels, e=config.flow_e, u=config.flow_u))
        else:
            self.scheduler = make_flow_scheduler(config.flow_policy, config.flow_levels)
        self.dscp = dscp_table(config.flow_levels)
        self.levels: dict[str, int] = {}
        self.sources: dict[str, str] = {}
        self.stages: dict[str, Stage] = {}

    def _permit(self, flow_id: str, level: int) -> FlowPermit:
        stage = self.stages[flow_id]
        self.ctx.metrics.flow_permits_total().labels(stage=stage.value, level=str(level)).inc()
        return FlowPermit(flow_id=flow_id, level=level, dscp=self.dscp.get(level, 0))

    def _count(self, key: str, name: str, doc: str, stage: str) -> None:
        metrics = self.ctx.metrics
        metrics.get(key, lambda: Counter(name, doc, ["stage"], registry=metrics.registry)).labels(stage=stage).inc()

    async def on_submit(self, msg: FlowSubmit | FlowSubmitBatch, _delivery) -> FlowPermit | FlowPermitBatch:
        if isinstance(msg, FlowSubmitBatch):
            return FlowPermitBatch(tuple(self.submit_one(f) for f in msg.flows))
        return self.submit_one(msg)

    def submit_one(self, msg: FlowSubmit) -> FlowPermit:
        try:
            stage = Stage(msg.stage)
            spec = FlowSpec(
                flow_id=msg.flow_id,
                request_id=msg.request_id,
                unit_id=msg.unit_id,
                stage=stage,
                size_bytes=msg.size_bytes,
                src=msg.src,
                dst=msg.dst,
                target_layer=msg.target_layer,
                deadline_ms=msg.deadline_unix_ms,
                request_deadlines_ms=msg.request_deadlines_unix_ms,
            )
        except ValueError as exc:
            self._count("flow_pruned", "nitsum_flow_pruned_total", "flows refused a permit (invalid or pruned)", msg.stage)
            return FlowPermit(flow_id=msg.flow_id, level=0, dscp=0, pruned=True, reason=f"invalid flow: {exc}")
        if msg.flow_id in self.stages:  # a retry of a flow already known: its current permit
            return self._permit(msg.flow_id, self.levels[msg.flow_id])
        self.stages[msg.flow_id] = stage
        self.sources[msg.flow_id] = msg.src
        self.scheduler.on_arrival(spec, _now_ms())
        level = self.scheduler.priorities(_now_ms()).get(msg.flow_id, self.scheduler.num_levels if hasattr(self.scheduler, "num_levels") else 8)
        self.levels[msg.flow_id] = level
        return self._permit(msg.flow_id, level)

    async def on_done(self, msg: FlowCompletion, _delivery) -> None:
        stage = self.stages.pop(msg.flow_id, None)
        if stage is None:
            return
        self.scheduler.on_complete(msg.flow_id, _now_ms())
        self.ctx.metrics.flow_bytes_total().labels(stage=stage.value).inc(msg.bytes_sent)
        self.levels.pop(msg.flow_id, None)
        self.sources.pop(msg.flow_id, None)

    async def tick(self) -> None:
        bus = self.ctx.bus
        while not self.ctx.stop.is_set():
            if self.levels:
                now = _now_ms()
                self.scheduler.on_tick(now)
                for flow_id, level in self.scheduler.priorities(now).items():
                    if flow_id in self.levels and level != self.levels[flow_id]:
                        self.levels[flow_id] = level
                        self._count("flow_promotions", "nitsum_flow_promotions_total", "flows moved to a higher level", self.stages[flow_id].value)
                        try:
                            await bus.publish(bus.subjects.flow_permit(self.sources[flow_id]), self._permit(flow_id, level))
                        except Exception as exc:  # the agent keeps its old level until the next change
                            log.warning("permit update for %s not sent: %s", flow_id, exc)
            try:
                await asyncio.wait_for(self.ctx.stop.wait(), timeout=TICK_S)
            except asyncio.TimeoutError:
                pass


async def body(ctx: ServiceContext) -> None:
    service = FlowService(ctx)
    bus = ctx.bus
    await bus.subscribe(bus.subjects.flow_submit, service.on_submit, queue="flow-scheduler", expected=(FlowSubmit, FlowSubmitBatch))
    await bus.subscribe(bus.subjects.flow_done, service.on_done, expected=FlowCompletion)
    task = ctx.spawn(service.tick(), "priority tick")

    async def stop() -> None:
        await asyncio.wait({task}, timeout=2.0)

    ctx.drain_hooks.append(stop)


def main(argv: list[str]) -> int:
    return run_service("flow-scheduler", FlowSchedulerConfig, argv[1:] if argv[:1] == ["flow-scheduler"] else argv, body)
