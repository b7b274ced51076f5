"""`nitsum serve flow-scheduler`: the central half of Nuska.

Transfer agents submit flows (FlowSubmit → FlowPermit with the flow's current level and DSCP, or a
FlowSubmitBatch → FlowPermitBatch for every flow of one request) and report completions; every tick the
scheduler re-evaluates MLU/RLI, and each promotion is pushed to the source agent as a new FlowPermit.

Live inputs (ALGORITHMS.md §2.4):
- Links: a flow with host ids (`src_host`, `dst_host`) runs on `<src_host>/up` and `<dst_host>/dn`, whose
  capacities come from NITSUM_FLOW_LINK_GBPS (host=Gb/s), else from the host's NIC speed its workers read
  from the kernel at boot and send with every flow (`src_link_gbps`, `dst_link_gbps`; a report replaces the
  default, never a configured value), else NITSUM_FLOW_DEFAULT_GBPS, and feed RMLQ's MLU. A flow without host
  ids runs on its worker ids' links at the default capacity.
- Link load ρ, tracked from the flows it permits: each active flow on a link is taken to get an equal share,
  and implicit flows (stages 1, 2) are served before explicit ones, so ρ = implicit flows / all flows on the
  link, capped at 0.9 (an explicit flow is never assumed to get nothing). Updated on submit and completion.
- LayerProgress (prefill workers, at layer boundaries): the unit's current layer (RLI promotion), its
  requests' TTFT deadlines (RED, σ), its flows' remaining bytes, and `done` (stage-3 flows go on the timer).
  Promotions it causes are pushed at once.
- Overload pruning on every batch arrival and departure (a submit that opens a unit, the last completion of
  one): RMLQ's worst-case feasibility check over σ, once per source link, each request's delay = its flows'
  remaining bytes there over their bottleneck's residual bandwidth (TP migrations are never pruned). A pruned request's flows get a
  FlowPermit with pruned=True, code "overload_pruned", at the lowest level (an agent should stop them; one
  that does not yet sends them where they disturb nothing), later flows of it are answered the same way, and
  a FlowPruned goes to the gateways (subject flow_pruned) so that the request is retried; nothing is dropped
  silently.
- PrefillAdmission (prefill workers, when they admit a request they will hand off, and when its prefill is
  over): the check on batch arrival covers requests that have sent nothing yet (paper §4.4.2, SIMULATOR.md
  rule 33). When a worker admits a batch, its pending requests are walked in σ (its compute is one queue),
  each delayed by what is left of the compute its worker estimated (the estimates run one after another from
  the first one's admission, first come first served, so elapsed time is taken off the oldest) plus its flows'
  transfer time, and all of them by the worker's fixed cost of a turn once (the queues: admissions.py). A
  pending request pruned gets a FlowPruned on its worker's permit subject (the worker ends its stream with the
  retryable `overload_pruned`, the gateway re-submits it) and on flow_pruned.
Counters: `nitsum_flow_permits_total{stage,level}`, `nitsum_flow_bytes_total{stage}`,
`nitsum_flow_promotions_total{stage}`, `nitsum_flow_pruned_total{stage}` (flows refused a permit),
`nitsum_flow_admission_pruned_total` (requests pruned before their prefill).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from prometheus_client import Counter

from nitsum.config import FlowSchedulerConfig
from nitsum.policy.flow_baselines import make_flow_scheduler
from nitsum.policy.flows import FlowSpec, RmlqConfig, RmlqScheduler, Stage, dscp_table
from nitsum.service import ServiceContext, run_service
from nitsum.wire.messages import (
    FlowCompletion,
    FlowPermit,
    FlowPermitBatch,
    FlowPruned,
    FlowSubmit,
    FlowSubmitBatch,
    LayerProgress,
    PrefillAdmission,
)
from nitsum_services.flow_scheduler.admissions import PrefillQueues

log = logging.getLogger("nitsum.flow_scheduler")

TICK_S = 0.01
MAX_LINK_LOAD = 0.9
PRUNED_CODE = "overload_pruned"
INVALID_CODE = "flow_invalid"
PRUNED_MEMORY = 10_000  # pruned request ids remembered (later flows of them are refused)


def _now_ms() -> float:
    return time.time() * 1000.0


class FlowService:
    def __init__(self, ctx: ServiceContext) -> None:
        config: FlowSchedulerConfig = ctx.config
        self.ctx = ctx
        self.host_bps = config.link_bandwidth_bps()
        self.default_bps = config.flow_default_gbps * 1e9
        if config.flow_policy == "rmlq":
            self.scheduler = RmlqScheduler(
                RmlqConfig(
                    num_levels=config.flow_levels,
                    e=config.flow_e,
                    u=config.flow_u,
                    default_bandwidth_bps=self.default_bps,
                )
            )
        else:
            self.scheduler = make_flow_scheduler(config.flow_policy, config.flow_levels)
        self.dscp = dscp_table(config.flow_levels)
        self.levels: dict[str, int] = {}
        self.sources: dict[str, str] = {}
        self.stages: dict[str, Stage] = {}
        self.paths: dict[str, tuple[str, ...]] = {}
        self.request_of: dict[str, str] = {}
        self.unit_of: dict[str, str] = {}
        self.unit_flows: dict[str, set[str]] = {}
        self.link_flows: dict[str, set[str]] = {}
        self.link_bps: dict[str, float] = {}
        self.link_source: dict[str, str] = {}  # link -> where its capacity came from: configured | nic | default
        self.rho: dict[str, float] = {}
        self.pruned_requests: dict[str, str] = {}  # request id -> reason (insertion order: oldest first)
        self.queues = PrefillQueues()  # the prefill workers' pending requests (PrefillAdmission)

    # ---- permits ----------------------------------------------------------------------------------
    def _permit(self, flow_id: str, level: int) -> FlowPermit:
        stage = self.stages[flow_id]
        self.ctx.metrics.flow_permits_total().labels(stage=stage.value, level=str(level)).inc()
        return FlowPermit(flow_id=flow_id, level=level, dscp=self.dscp.get(level, 0))

    def _refusal(self, flow_id: str, stage: str, reason: str, code: str) -> FlowPermit:
        """Invalid: level 0. Pruned: the lowest level and its DSCP, so that an agent that does not stop a
        pruned flow yet still sends it where it disturbs nothing (and never mistakes it for a promotion)."""
        self._count("flow_pruned", "nitsum_flow_pruned_total", "flows refused a permit (invalid or pruned)", stage)
        if code == PRUNED_CODE:
            lowest = self.scheduler.num_levels
            return FlowPermit(flow_id, lowest, self.dscp.get(lowest, 0), pruned=True, reason=reason, code=code)
        return FlowPermit(flow_id=flow_id, level=0, dscp=0, pruned=True, reason=reason, code=code)

    def _count(self, key: str, name: str, doc: str, stage: str) -> None:
        metrics = self.ctx.metrics
        metrics.get(key, lambda: Counter(name, doc, ["stage"], registry=metrics.registry)).labels(stage=stage).inc()

    # ---- links ------------------------------------------------------------------------------------
    def _path(self, msg: FlowSubmit) -> tuple[str, ...]:
        src = msg.src_host or msg.src
        dst = msg.dst_host or msg.dst
        path = (f"{src}/up", f"{dst}/dn")
        reported = (msg.src_link_gbps if msg.src_host else 0.0, msg.dst_link_gbps if msg.dst_host else 0.0)
        for link, host, gbps in zip(path, (src, dst), reported):
            if host in self.host_bps:
                bps, source = self.host_bps[host], "configured"
            elif gbps > 0 and math.isfinite(gbps):
                bps, source = gbps * 1e9, "nic"
            else:
                bps, source = self.default_bps, "default"
            known = self.link_source.get(link)
            if known is not None and not (source == "nic" and known in ("default", "nic")):
                continue  # a configured capacity, or a report against one, stays as it is
            if known == "nic":  # several workers of the host report: its fastest NIC
                bps = max(bps, self.link_bps[link])
            if self.link_bps.get(link) != bps:
                self.link_bps[link] = bps
                if isinstance(self.scheduler, RmlqScheduler):
                    self.scheduler.set_link_bandwidth(link, bps)
            self.link_source[link] = source
        return path

    def _update_load(self, links: tuple[str, ...], now: float) -> None:
        if not isinstance(self.scheduler, RmlqScheduler):
            return
        for link in links:
            flows = self.link_flows.get(link, ())
            implicit = sum(1 for f in flows if not self.stages[f].explicit)
            rho = min(implicit / len(flows), MAX_LINK_LOAD) if flows else 0.0
            if abs(rho - self.rho.get(link, 0.0)) > 1e-9:
                self.rho[link] = rho
                self.scheduler.set_link_load(link, rho, now)

    # ---- submit / done ----------------------------------------------------------------------------
    async def on_submit(self, msg: FlowSubmit | FlowSubmitBatch, _delivery) -> FlowPermit | FlowPermitBatch:
        flows = msg.flows if isinstance(msg, FlowSubmitBatch) else (msg,)
        new_unit = False
        permits = []
        for f in flows:
            permit, opened = self.submit_one(f)
            permits.append(permit)
            new_unit = new_unit or opened
        if new_unit:  # a batch arrived: the feasibility check
            await self._prune(_now_ms())
            permits = [self._current(p, f.request_id) for p, f in zip(permits, flows)]
        return FlowPermitBatch(tuple(permits)) if isinstance(msg, FlowSubmitBatch) else permits[0]

    def _current(self, permit: FlowPermit, rid: str) -> FlowPermit:
        """A permit as it stands after pruning (a flow pruned meanwhile is refused, not permitted)."""
        if not permit.pruned and rid in self.pruned_requests:
            lowest = self.scheduler.num_levels
            return FlowPermit(
                permit.flow_id,
                lowest,
                self.dscp.get(lowest, 0),
                pruned=True,
                reason=self.pruned_requests[rid],
                code=PRUNED_CODE,
            )
        return permit

    def submit_one(self, msg: FlowSubmit) -> tuple[FlowPermit, bool]:
        if msg.request_id in self.pruned_requests:
            return self._refusal(msg.flow_id, msg.stage, self.pruned_requests[msg.request_id], PRUNED_CODE), False
        try:
            stage = Stage(msg.stage)
            path = self._path(msg)
            spec = FlowSpec(
                flow_id=msg.flow_id,
                request_id=msg.request_id,
                unit_id=msg.unit_id,
                stage=stage,
                size_bytes=msg.size_bytes,
                src=msg.src,
                dst=msg.dst,
                path=path,
                target_layer=msg.target_layer,
                deadline_ms=msg.deadline_unix_ms,
                request_deadlines_ms=msg.request_deadlines_unix_ms,
                request_deadline_ms=min(msg.request_deadlines_unix_ms)
                if msg.request_deadlines_unix_ms
                else msg.deadline_unix_ms,
            )
        except ValueError as exc:
            return self._refusal(msg.flow_id, msg.stage, f"invalid flow: {exc}", INVALID_CODE), False
        if msg.flow_id in self.stages:  # a retry of a flow already known: its current permit
            return self._permit(msg.flow_id, self.levels[msg.flow_id]), False
        now = _now_ms()
        if stage is Stage.P2D:  # its prefill is over
            self.queues.prefilled(msg.request_id)
        self.stages[msg.flow_id] = stage
        self.sources[msg.flow_id] = msg.src
        self.paths[msg.flow_id] = path
        self.request_of[msg.flow_id] = msg.request_id
        self.unit_of[msg.flow_id] = msg.unit_id
        opened = msg.unit_id not in self.unit_flows
        self.unit_flows.setdefault(msg.unit_id, set()).add(msg.flow_id)
        for link in path:
            self.link_flows.setdefault(link, set()).add(msg.flow_id)
        self.scheduler.on_arrival(spec, now)
        self._update_load(path, now)
        level = self.scheduler.priorities(now).get(msg.flow_id, self.scheduler.num_levels)
        self.levels[msg.flow_id] = level
        return self._permit(msg.flow_id, level), opened

    async def on_done(self, msg: FlowCompletion, _delivery) -> None:
        closed = self._forget(msg.flow_id, msg.bytes_sent)
        if closed:  # a batch departed: the feasibility check
            await self._prune(_now_ms())

    def _forget(self, flow_id: str, bytes_sent: int) -> bool:
        """Drop a finished (or withdrawn) flow; True when it was its unit's last one."""
        stage = self.stages.pop(flow_id, None)
        if stage is None:
            return False
        now = _now_ms()
        self.scheduler.on_complete(flow_id, now)
        if bytes_sent:
            self.ctx.metrics.flow_bytes_total().labels(stage=stage.value).inc(bytes_sent)
        self.levels.pop(flow_id, None)
        self.sources.pop(flow_id, None)
        self.request_of.pop(flow_id, None)
        path = self.paths.pop(flow_id, ())
        for link in path:
            self.link_flows.get(link, set()).discard(flow_id)
        self._update_load(path, now)
        unit = self.unit_of.pop(flow_id, None)
        flows = self.unit_flows.get(unit, set())
        flows.discard(flow_id)
        if unit is not None and not flows:
            self.unit_flows.pop(unit, None)
            return True
        return False

    # ---- layer progress and prefill admissions ----------------------------------------------------
    async def on_progress(self, msg: LayerProgress | PrefillAdmission, delivery) -> None:
        if isinstance(msg, PrefillAdmission):
            await self.on_admission(msg)
        else:
            await self.on_layer_progress(msg, delivery)

    async def on_admission(self, msg: PrefillAdmission) -> None:
        """A prefill worker admitted requests (the check on their arrival runs now) or finished their prefill.
        A prune taken back (a request that goes on after all) is taken back here and in the scheduler's table:
        its hand-off is checked against its own deadline, not refused for the prefill it has done."""
        now = _now_ms()
        taken = self.queues.report(msg, now)
        if taken is None:
            return
        unprune, admitted = taken
        for rid in unprune:
            self.pruned_requests.pop(rid, None)
            self.scheduler.unprune(rid)
        if admitted:  # a batch arrived: the feasibility check, on the worker it arrived at (nothing else changed)
            await self._prune(now, only_worker=msg.worker_id)

    async def on_layer_progress(self, msg: LayerProgress, _delivery) -> None:
        now = _now_ms()
        sched = self.scheduler
        for f in msg.flows:
            st = sched.state(f.flow_id)
            if st is not None and 0 <= f.remaining_bytes <= st.remaining_bytes:
                sched.on_progress(f.flow_id, f.remaining_bytes, now)
        if msg.request_deadlines_unix_ms:
            sched.set_unit_deadlines(msg.unit_id, msg.request_deadlines_unix_ms, now)
        if msg.layer >= 0:
            sched.on_layer_boundary(msg.unit_id, msg.layer, now)
        if msg.done:
            sched.on_unit_done(msg.unit_id, now)
        await self._push_changes(now)

    # ---- pruning ----------------------------------------------------------------------------------
    async def _prune(self, now: float, only_worker: str | None = None) -> None:
        """The worst-case check once per source link: the requests whose flows leave through it, each delayed
        by its remaining bytes there over the link's residual bandwidth, walked in σ (flows on different
        uplinks do not queue behind each other, so one global walk would prune far too much). With
        `only_worker` (an admission there) instead: that prefill worker's pending requests, its compute queue."""
        sched = self.scheduler
        per_link: dict[str, dict[str, float]] = {}
        flow_ms: dict[str, float] = {}  # request id -> its flows' transfer time, over every link
        for fid, rid in self.request_of.items():
            st = sched.state(fid)
            if st is None or st.pruned or st.stage is Stage.MIGRATION:
                continue  # a TP migration is never pruned: its cutover waits for it
            path = self.paths[fid]
            bps = min(self.link_bps[l] * (1.0 - self.rho.get(l, 0.0)) for l in path)
            est = per_link.setdefault(path[0], {})
            ms = st.remaining_bytes * 8.0 / bps * 1000.0
            est[rid] = est.get(rid, 0.0) + ms
            flow_ms[rid] = flow_ms.get(rid, 0.0) + ms
        victims: list[str] = []
        if only_worker is None:  # (a flow's arrival or departure changes no worker's compute queue)
            for link in sorted(per_link):
                victims.extend(r for r in sched.prune(now, per_link[link]) if r not in victims)
        else:  # the worker's compute is one queue
            est, pending = self.queues.walk_inputs(only_worker, now, flow_ms, victims)
            if est:
                victims.extend(r for r in sched.prune(now, est, pending) if r not in victims)
        bus = self.ctx.bus
        for rid in victims:
            reason = "pruned: its transfers cannot meet its TTFT deadline under the current load"
            admitted = self.queues.pruned_now(rid)
            if admitted is not None:
                reason = "pruned: its prefill cannot meet its TTFT deadline under the current load"
                self._count_admission_pruned()
                try:
                    await bus.publish(
                        bus.subjects.flow_permit(admitted.worker_id),
                        FlowPruned(request_id=rid, code=PRUNED_CODE, reason=reason),
                    )
                except Exception as exc:
                    log.warning("FlowPruned for %s not sent to %s: %s", rid, admitted.worker_id, exc)
            self.pruned_requests[rid] = reason
            while len(self.pruned_requests) > PRUNED_MEMORY:
                self.pruned_requests.pop(next(iter(self.pruned_requests)))
            fids = tuple(sorted(f for f, r in self.request_of.items() if r == rid))
            for fid in fids:
                permit = self._refusal(fid, self.stages[fid].value, reason, PRUNED_CODE)
                src = self.sources[fid]
                self._forget(fid, 0)
                try:
                    await bus.publish(bus.subjects.flow_permit(src), permit)
                except Exception as exc:
                    log.warning("pruned permit for %s not sent: %s", fid, exc)
            log.info("pruned request %s (%d flows)", rid, len(fids))
            try:
                await bus.publish(
                    bus.subjects.flow_pruned, FlowPruned(request_id=rid, code=PRUNED_CODE, reason=reason, flow_ids=fids)
                )
            except Exception as exc:
                log.warning("FlowPruned for %s not sent: %s", rid, exc)

    def _count_admission_pruned(self) -> None:
        metrics = self.ctx.metrics
        metrics.get(
            "flow_admission_pruned",
            lambda: Counter(
                "nitsum_flow_admission_pruned_total",
                "requests pruned before their prefill (the overload check on batch arrival)",
                registry=metrics.registry,
            ),
        ).inc()

    # ---- promotions -------------------------------------------------------------------------------
    async def _push_changes(self, now: float) -> None:
        bus = self.ctx.bus
        for flow_id, level in self.scheduler.priorities(now).items():
            if flow_id in self.levels and level != self.levels[flow_id]:
                self.levels[flow_id] = level
                self._count(
                    "flow_promotions",
                    "nitsum_flow_promotions_total",
                    "flows moved to a higher level",
                    self.stages[flow_id].value,
                )
                try:
                    await bus.publish(bus.subjects.flow_permit(self.sources[flow_id]), self._permit(flow_id, level))
                except Exception as exc:  # the agent keeps its old level until the next change
                    log.warning("permit update for %s not sent: %s", flow_id, exc)

    async def tick(self) -> None:
        while not self.ctx.stop.is_set():
            if self.levels:
                now = _now_ms()
                self.scheduler.on_tick(now)
                await self._push_changes(now)
            try:
                await asyncio.wait_for(self.ctx.stop.wait(), timeout=TICK_S)
            except TimeoutError:
                pass


async def body(ctx: ServiceContext) -> FlowService:
    """The service on the bus (returned for tests that look at its scheduler)."""
    service = FlowService(ctx)
    bus = ctx.bus
    await bus.subscribe(
        bus.subjects.flow_submit, service.on_submit, queue="flow-scheduler", expected=(FlowSubmit, FlowSubmitBatch)
    )
    await bus.subscribe(bus.subjects.flow_done, service.on_done, expected=FlowCompletion)
    await bus.subscribe(bus.subjects.flow_progress, service.on_progress, expected=(LayerProgress, PrefillAdmission))
    task = ctx.spawn(service.tick(), "priority tick")

    async def stop() -> None:
        await asyncio.wait({task}, timeout=2.0)

    ctx.drain_hooks.append(stop)
    return service


def main(argv: list[str]) -> int:
    return run_service(
        "flow-scheduler", FlowSchedulerConfig, argv[1:] if argv[:1] == ["flow-scheduler"] else argv, body
    )
