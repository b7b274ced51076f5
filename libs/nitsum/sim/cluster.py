"""The Nitsum cluster: nodes of D devices partitioned into TP groups, driven by a `nitsum.policy` Policy.

What each piece does (the same decisions as the live coordinator, through the same objects):
- arrival: `policy.admit(snapshot, request)`, then `policy.route(...)` to a prefill-capable group;
- every policy epoch: `policy.shed(...)` and `policy.decide_topology(...)`; a new topology pauses the
  groups it changes for the reconfiguration cost (switch cost + KV bytes / link bandwidth, from the cost
  model, or a fixed override) and their requests are re-routed with their KV (never recomputed);
- a group runs engine steps back to back: continuous batching, chunked prefill on hybrid groups, prefill
  batches on prefill groups, decode only on decode groups; step time from `CostModel.step_time_ms`;
- P/D hand-off (prefill group -> decode group, routed by `policy.route` with the request prefilled): the KV
  moves over NVLink inside a node, over the NICs between nodes.
Outputs are `nitsum.metrics.RequestRecord`s, summarized by the one metric schema.
What a run is configured with is `cluster_config.ClusterConfig`; the state it mutates (requests, groups,
nodes, and each group's next engine step) is in `cluster_state`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from nitsum.metrics import Report, RequestRecord, summarize
from nitsum.policy.decisions import node_topology
from nitsum.policy.registry import make_policy
from nitsum.policy.snapshot import ArrivalStats, ArrivalWindow, ClusterSnapshot, NodeView, assemble_snapshot
from nitsum.policy.tiers import DEFAULT_TIERS
from nitsum.sim.cluster_config import ClusterConfig
from nitsum.sim.cluster_state import SimGroup, SimNode, SimRequest
from nitsum.sim.engine import Event, Simulator
from nitsum.sim.service import ServiceSampler
from nitsum.topology import Topology
from nitsum.workloads.request import TraceRequest


@dataclass
class ClusterResult:
    records: list[RequestRecord]
    report: Report
    reconfigurations: int
    reconfig_pause_ms: float
    events: int
    sim_ms: float
    wall_s: float
    topologies: list[tuple[float, str, str]] = field(default_factory=list)  # (time, node, topology)
    layouts: list[tuple[float, str, Topology]] = field(default_factory=list)  # the same, as Topology objects


class ClusterSim:
    """One run: a policy, a cluster, a workload. `run()` returns a ClusterResult."""

    def __init__(self, policy: Any, config: ClusterConfig, workload: list[TraceRequest]) -> None:
        self.policy = make_policy(policy, config.policy_config()) if isinstance(policy, str) else policy
        self.config = config
        self.tiers = dict(config.tiers)
        self.cost = config.cost_model()
        self.service = ServiceSampler(config.service) if config.service is not None else None
        self.workload = sorted(workload, key=lambda r: r.arrival_ms)
        self.sim = Simulator()
        self.nodes = [SimNode(f"n{i}") for i in range(config.num_nodes)]
        self.reqs: list[SimRequest] = []
        self.live: dict[str, SimRequest] = {}
        self.coordinator_queue: list[SimRequest] = []
        w = config.arrival_window_ms
        self.arrivals = (
            ArrivalWindow(w, started_ms=0.0, regime_ms=config.arrival_regime_ms, detect_shifts=True) if w > 0 else None
        )
        self._started = False
        self.reconfigs = 0
        self.pause_ms = 0.0
        self.topologies: list[tuple[float, str, str]] = []
        self.layouts: list[tuple[float, str, Topology]] = []
        self.end_arrivals_ms = self.workload[-1].arrival_ms if self.workload else 0.0
        self.p2d_link = config.inter_node_bandwidth_bps / 8 / 1000  # bytes/ms
        self.nvlink = self.cost.device.link_bandwidth_bytes_per_s * self.cost.device.link_efficiency / 1000
        for node in self.nodes:
            topo = self.policy.initial_topology(self._node_view(node))
            self._build(node, topo, 0.0, 0.0)

    # -- views ---------------------------------------------------------------------------------------------
    def _node_view(self, node: SimNode) -> NodeView:
        c = self.config
        return NodeView(
            node_id=node.node_id,
            num_devices=c.devices_per_node,
            min_tp=c.min_tp,
            max_tp=c.max_tp,
            groups=tuple(g.view(c.block_size_tokens) for g in node.groups),
            device_kind=c.device_name,
            last_reconfig_ms=node.last_reconfig_ms,
        )

    def snapshot(self, full: bool = True, arrivals: bool = False) -> ClusterSnapshot:
        """`full=False` lists only requests not yet prefilled: all that prefill routing, admission and
        shedding read (their loads come from prefill work), and much cheaper at high load. `arrivals`: with the
        arrival window's per-tier stats (epochs). Built by the policy's own `assemble_snapshot`, as the live
        coordinator builds it."""
        if full:
            views = [r.view() for r in self.live.values()]
        else:
            views = [r.view() for r in self.live.values() if r.first_token is None]
        return assemble_snapshot(
            self.sim.now_ms,
            [self._node_view(n) for n in self.nodes],
            views,
            arrivals=self.arrivals if arrivals and self.arrivals is not None else None,
            load_shift_ms=None if self.arrivals is None else self.arrivals.shift_ms,
        )

    def arrival_stats(self) -> tuple[ArrivalStats, ...]:
        """Per tier, the arrivals of the last `arrival_window_ms` (shorter at the start of the run)."""
        if self.arrivals is None or self.sim.now_ms <= 0:
            return ()
        return self.arrivals.stats(self.sim.now_ms)

    def _group(self, gid: str) -> SimGroup | None:
        for n in self.nodes:
            for g in n.groups:
                if g.gid == gid:
                    return g
        return None

    # -- topology ------------------------------------------------------------------------------------------
    def _build(self, node: SimNode, topo: Topology, now: float, pause_ms: float) -> list[SimGroup]:
        topo.validate(self.config.devices_per_node, self.config.min_tp, self.config.max_tp)
        keep = {(g.start, g.tp, g.role): g for g in node.groups}
        new_groups, created = [], []
        for spec in topo.groups:
            g = keep.pop((spec.start, spec.tp, spec.role), None)
            if g is None:
                g = SimGroup(node, spec.start, spec.tp, spec.role, self.cost, now, now + pause_ms)
                created.append(g)
            new_groups.append(g)
        for g in keep.values():
            g.retired = True
            g.version += 1
        node.groups = new_groups
        self.topologies.append((now, node.node_id, str(topo)))
        self.layouts.append((now, node.node_id, topo))
        return created

    def _reconfigure(self, node: SimNode, topo: Topology) -> list[Event]:
        now = self.sim.now_ms
        old = {(g.start, g.tp, g.role): g for g in node.groups}
        changed = [g for key, g in old.items() if key not in {(s.start, s.tp, s.role) for s in topo.groups}]
        moving: list[SimRequest] = []
        for g in changed:
            moving.extend(r for _, _, r in g.waiting)
            moving.extend(g.prefilling)
            moving.extend(g.running)
        kv_bytes = (
            sum(r.prompt + r.generated() for r in moving if r.prefill_done or r.first_token is not None)
            * self.cost.model.kv_bytes_per_token
        )
        devices = sum(g.tp for g in changed)
        if self.config.reconfig_cost_ms is not None:
            pause = self.config.reconfig_cost_ms
        else:
            pause = self.cost.reconfig_cost_ms(kv_bytes, devices)
        # Snapshot each moving request's progress before its group goes away.
        for r in moving:
            r.detach()
        self._build(node, topo, now, pause)
        node.last_reconfig_ms = now
        self.reconfigs += 1
        self.pause_ms += pause
        events: list[Event] = []
        for r in moving:
            events.extend(self._place(r, decode=r.first_token is not None, ready_at=now + pause))
        for g in node.groups:
            events.extend(self._kick(g))
        return events

    # -- request placement ---------------------------------------------------------------------------------
    def _arrive(self, sim: Simulator, payload: tuple[int, TraceRequest, float, bool]) -> list[Event]:
        index, t, path_ms, stalled = payload
        tier = self.tiers.get(t.tier) or DEFAULT_TIERS["interactive"]
        r = SimRequest(f"r{index}", t, tier)
        r.path_ms, r.stalled = path_ms, stalled
        self.reqs.append(r)
        if self.arrivals is not None:
            self.arrivals.add(sim.now_ms, r.tier, r.ttft_slo, r.tpot_slo, r.weight, r.prompt, r.output)
        snap = self.snapshot(full=False)
        decision = self.policy.admit(snap, r.view())
        if not decision.admit:
            r.error = f"http_{decision.status}"
            return []
        self.live[r.rid] = r
        return self._place(r, decode=False, snap=snap)

    def _place(
        self, r: SimRequest, decode: bool, snap: ClusterSnapshot | None = None, ready_at: float | None = None
    ) -> list[Event]:
        if snap is None:
            snap = self.snapshot(full=decode)
        d = self.policy.route(snap, r.view())
        g = self._group(d.group_id) if d.group_id is not None else None
        if g is None or not g.healthy:
            self.coordinator_queue.append(r)
            return []
        if decode:
            return self._join_decode(g, r, ready_at)
        g.seq += 1
        heapq.heappush(g.waiting, (r.arrival + r.ttft_slo, g.seq, r))
        r.group = g
        return self._kick(g)

    def _join_decode(self, g: SimGroup, r: SimRequest, ready_at: float | None = None) -> list[Event]:
        now = self.sim.now_ms
        if ready_at is not None and ready_at > now:
            return [(ready_at, self._join_decode_ev, (g, r, g.version))]
        return self._join_decode_now(g, r)

    def _join_decode_ev(self, sim: Simulator, payload: tuple) -> list[Event]:
        g, r, version = payload
        if g.retired or g.version != version:
            return self._place(r, decode=True)
        return self._join_decode_now(g, r)

    def _join_decode_now(self, g: SimGroup, r: SimRequest) -> list[Event]:
        r.group = g
        need = r.prompt + r.output
        r.kv_tokens = need
        g.kv_used += need
        left = r.output - r.base_gen
        if left <= 0:
            return self._finish(r, self.sim.now_ms)
        r.join_step = g.step
        if self.service is not None:  # the slowdown of the window its decode starts in holds for all of it
            r.ratio = self.service.step_ratio(self.sim.now_ms)
        g.running[r] = g.step + left
        g.add_running_tpot(r.tpot_slo)
        g.ctx_base += r.prompt + r.base_gen - g.step
        g.seq += 1
        heapq.heappush(g.finish_heap, (g.step + left, g.seq, r))
        return self._kick(g)

    def _finish(self, r: SimRequest, now: float) -> list[Event]:
        r.finish = now
        if r.group is not None:
            r.group.kv_used -= r.kv_tokens
        r.kv_tokens = 0
        self.live.pop(r.rid, None)
        return []

    # -- engine steps --------------------------------------------------------------------------------------
    def _kick(self, g: SimGroup) -> list[Event]:
        if g.busy or g.retired:
            return []
        now = self.sim.now_ms
        if g.paused_until > now:
            g.busy = True
            return [(g.paused_until, self._resume, (g, g.version))]
        planned, tokens, n_dec, dec_ctx = g.plan_step(self.config)
        if not planned and n_dec == 0:
            return []
        ctx = dec_ctx + sum(r.prefill_done + n for r, n in planned)
        step_ms = g.cost.step_time_ms(g.tp, n_dec + len(planned), n_dec + tokens, ctx)
        if self.service is not None and not planned:  # decode-only steps; see sim/service.py for prefill
            step_ms *= sum(r.ratio for r in g.running) / n_dec  # O(batch): only simulations with a service model
        g.busy = True
        return [(now + step_ms, self._step_done, (g, g.version, planned))]

    def _resume(self, sim: Simulator, payload: tuple) -> list[Event]:
        g, version = payload
        if g.version != version or g.retired:
            return []
        g.busy = False
        return self._kick(g)

    def _step_done(self, sim: Simulator, payload: tuple) -> list[Event]:
        g, version, planned = payload
        if g.version != version or g.retired:
            return []  # the group was reconfigured away mid-step; its requests moved with their progress
        now = sim.now_ms
        # g stays busy while this step's outcomes are applied, so a join below cannot start a step early
        events: list[Event] = []
        if g.role != "prefill" and g.running:
            g.step += 1
            fh = g.finish_heap
            while fh and fh[0][0] <= g.step:
                _, _, r = heapq.heappop(fh)
                if g.running.get(r) is None:
                    continue
                del g.running[r]
                g.drop_running_tpot(r.tpot_slo)
                g.ctx_base -= r.prompt + r.base_gen - r.join_step  # its term, as added when it joined
                r.base_gen = r.output
                events.extend(self._finish(r, now))
        for r, n in planned:
            r.prefill_done += n
            if r.prefill_done >= r.prompt:
                g.prefilling.remove(r)
                r.in_prefill = False
                r.first_token = now
                r.base_gen = 1
                if r.output <= 1:
                    events.extend(self._finish(r, now))
                elif g.role == "hybrid":
                    g.kv_used -= r.kv_tokens
                    r.kv_tokens = 0
                    events.extend(self._join_decode_now(g, r))
                else:
                    g.kv_used -= r.kv_tokens
                    r.kv_tokens = 0
                    events.extend(self._handoff(r, g))
        g.busy = False
        events.extend(self._kick(g))
        return events

    def _handoff(self, r: SimRequest, src: SimGroup) -> list[Event]:
        """P/D: route to a decode group; the KV travels over NVLink (same node) or the NICs."""
        snap = self.snapshot(full=True)
        d = self.policy.route(snap, r.view())
        g = self._group(d.group_id) if d.group_id is not None else None
        if g is None:
            self.coordinator_queue.append(r)
            r.group = None
            return []
        kv_bytes = r.prompt * self.cost.model.kv_bytes_per_token
        bw = self.nvlink * min(src.tp, g.tp) if g.node is src.node else self.p2d_link
        r.group = None
        return [(self.sim.now_ms + kv_bytes / bw, self._join_decode_ev, (g, r, g.version))]

    # -- epochs --------------------------------------------------------------------------------------------
    def _epoch(self, sim: Simulator, _: Any) -> list[Event]:
        events: list[Event] = []
        if self.coordinator_queue:
            queued, self.coordinator_queue = self.coordinator_queue, []
            for r in queued:
                events.extend(self._place(r, decode=r.first_token is not None))
        snap = self.snapshot(full=False)
        for rid in self.policy.shed(snap):
            r = self.live.get(rid)
            if r is None or r.first_token is not None or r.in_prefill:
                continue  # only requests still waiting can be shed
            g = r.group
            if g is not None:
                g.waiting = [e for e in g.waiting if e[2] is not r]
                heapq.heapify(g.waiting)
            r.error = "shed"
            self.live.pop(rid, None)
        full = self.snapshot(full=True, arrivals=True)
        for decision in self.policy.decide_topology(full):
            if decision.target is None:
                continue
            node = next(n for n in self.nodes if n.node_id == decision.node_id)
            if decision.target == node_topology(self._node_view(node)):
                continue
            events.extend(self._reconfigure(node, decision.target))
        if sim.now_ms < self.end_arrivals_ms + self.config.drain_ms and (
            self.live or sim.now_ms < self.end_arrivals_ms
        ):
            events.append((sim.now_ms + self.config.epoch_ms, self._epoch, None))
        return events

    # -- run -----------------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        for index, t in enumerate(self.workload):
            # With a service model each request draws its path (in arrival order); it delays what the client
            # sees, not when the engine gets the request (see sim/service.py).
            path, stalled = self.service.path() if self.service is not None else (0.0, False)
            self.sim.schedule(t.arrival_ms, self._arrive, (index, t, path, stalled))
        self.sim.schedule(0.0, self._epoch, None)

    def run_until(self, until_ms: float) -> None:
        """Advance the run to `until_ms` (its snapshot then shows that instant); `run` continues from there."""
        self._start()
        self.sim.run(until_ms=until_ms)

    def run(self, duration_s: float | None = None) -> ClusterResult:
        sim = self.sim
        self._start()
        sim.run(until_ms=self.end_arrivals_ms + self.config.drain_ms)
        records = [r.record() for r in self.reqs]
        window = duration_s if duration_s is not None else max(self.end_arrivals_ms / 1000.0, 1e-3)
        report = summarize(records, duration_s=window, tier_order=tuple(self.tiers))
        return ClusterResult(
            records,
            report,
            self.reconfigs,
            self.pause_ms,
            sim.events_run,
            sim.now_ms,
            sim.wall_s,
            self.topologies,
            self.layouts,
        )


def run_cluster(policy: str, config: ClusterConfig, workload: list[TraceRequest]) -> ClusterResult:
    return ClusterSim(policy, config, workload).run()


__all__ = ["ClusterConfig", "ClusterResult", "ClusterSim", "run_cluster"]
