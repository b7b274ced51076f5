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

Decode accounting is O(1) per step: a running request's generated count is `step - join_step + base`, and
finishes come off a heap keyed by the step index at which it emits its last token.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nitsum.metrics import Report, RequestRecord, summarize
from nitsum.policy.base import PolicyConfig
from nitsum.policy.costmodel import CostModel, DeviceSpec, cost_model, resolve_device
from nitsum.policy.decisions import node_topology
from nitsum.policy.estimate import MIN_CHUNK_TOKENS
from nitsum.policy.registry import make_policy
from nitsum.policy.snapshot import (
    ArrivalStats,
    ArrivalWindow,
    ClusterSnapshot,
    GroupView,
    NodeView,
    RequestView,
    assemble_snapshot,
    group_id_of,
)
from nitsum.policy.steptable import DeviceStepTable, StepRow, load_step_rows, select
from nitsum.policy.tiers import DEFAULT_TIERS, Tier
from nitsum.sim.engine import Event, Simulator
from nitsum.sim.service import ServiceModel, ServiceSampler
from nitsum.topology import Topology
from nitsum.workloads.request import TraceRequest


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "llama-3-70b"
    # A preset ("cpu" is the shipped CPU table; "h100" | "h200" | "a100"), a device table JSON path (what
    # `nitsum bench profile --out` writes), a loaded DeviceSpec or a CostModel. The policy gets the same table.
    device_kind: str | Path | DeviceSpec | CostModel = "h100"
    # A measured step-time table (CSV path or parsed rows; policy/steptable.py): steps of every group are priced
    # from its rows for (this device's name, this model), and the policy's estimator reads the same table.
    device_table: str | Path | tuple[StepRow, ...] | None = None
    num_nodes: int = 1
    devices_per_node: int = 8
    min_tp: int = 1
    max_tp: int = 8
    chunk_tokens: int = 512  # largest prefill chunk per step on a hybrid group (chunked prefill)
    # Sarathi-style SLO-aware token budget: a hybrid step's prefill chunk is halved (down to
    # min_chunk_tokens) until the step fits the tightest TPOT among the group's running requests. With a
    # fixed 512-token chunk a Llama-3-70B TP8 step takes 26 ms, so every interactive request (25 ms TPOT)
    # decoding beside a prefill missed its TPOT whatever the topology. False: always chunk_tokens.
    tpot_aware_chunks: bool = True
    min_chunk_tokens: int = MIN_CHUNK_TOKENS  # prefill never stalls completely behind a decode batch
    # True: a hybrid step's chunk_tokens budget also pays for its decode tokens, as nitsum's own engine
    # schedules (engine/scheduler.py: running sequences take one token each first, prefill gets the rest);
    # False: the budget is for prefill tokens only (decodes ride along, as in the Sarathi-style model).
    decode_tokens_in_budget: bool = False
    prefill_batch_tokens: int = 8192  # prefill tokens per step on a prefill group
    max_batch: int = 256  # sequences in one decode batch
    block_size_tokens: int = 16
    epoch_ms: float = 1000.0  # NITSUM_RECONFIG_INTERVAL_MS
    reconfig_cost_ms: float | None = None  # None: cost model; else this fixed pause per reconfiguration
    inter_node_bandwidth_bps: float = 8 * 400e9  # P/D hand-off between nodes (8 x 400 Gb/s NICs)
    # Arrivals per tier over this sliding window go into each epoch's snapshot (ClusterSnapshot.arrivals),
    # as a coordinator would measure them; 0 leaves them out (the policy then scores the backlog only).
    arrival_window_ms: float = 5000.0
    # ... and over the whole steady stretch since the stream last shifted, up to this long (ArrivalWindow.regime_ms).
    arrival_regime_ms: float = 60_000.0
    drain_ms: float = 30_000.0  # after the last arrival, how long in-flight requests may still finish
    tiers: tuple[tuple[str, Tier], ...] = tuple(DEFAULT_TIERS.items())
    # What the live mesh adds to the table's engine steps (request path, step noise); None: engine steps only.
    service: ServiceModel | None = None

    def __post_init__(self) -> None:
        _ = self.device  # an unknown kind or a missing table file fails here, with the accepted forms named
        self.step_table()  # a malformed step table fails here, naming its line and column
        if isinstance(self.device_kind, CostModel) and self.device_kind.model.name != self.model:
            raise ValueError(
                f"device_kind is a cost model of {self.device_kind.model.name!r}, the cluster runs {self.model!r}"
            )

    @property
    def device(self) -> DeviceSpec:
        return resolve_device(self.device_kind)

    @property
    def device_name(self) -> str:
        """The kind the nodes report (NodeView.device_kind): the preset's name, or the given table's name."""
        return (
            self.device_kind
            if isinstance(self.device_kind, str) and not self.device_kind.endswith(".json")
            else self.device.name
        )

    def step_table(self) -> DeviceStepTable | None:
        if self.device_table is None:
            return None
        from nitsum.policy.costmodel import model_spec

        rows = self.device_table if isinstance(self.device_table, tuple) else load_step_rows(self.device_table)
        source = "device table" if isinstance(self.device_table, tuple) else str(self.device_table)
        return select(rows, self.device_name, model_spec(self.model), source)

    def cost_model(self) -> CostModel:
        if isinstance(self.device_kind, CostModel):
            return self.device_kind
        base = cost_model(self.model, self.device)
        steps = self.step_table()
        return base if steps is None else CostModel(base.model, base.device, steps=steps)

    def policy_config(self) -> PolicyConfig:
        from nitsum.policy.costmodel import model_spec

        return PolicyConfig(
            model=model_spec(self.model),
            epoch_ms=self.epoch_ms,
            block_size_tokens=self.block_size_tokens,
            chunk_tokens=self.chunk_tokens,
            prefill_batch_tokens=self.prefill_batch_tokens,
            devices=((self.device_name, self.device),),
            step_tables=() if self.device_table is None else ((self.device_name, self.step_table()),),
        )


class _Req:
    __slots__ = (
        "rid",
        "tier",
        "ttft_slo",
        "tpot_slo",
        "weight",
        "arrival",
        "prompt",
        "output",
        "prefill_done",
        "first_token",
        "finish",
        "group",
        "join_step",
        "base_gen",
        "error",
        "in_prefill",
        "kv_tokens",
        "deadline",
        "path_ms",
        "stalled",
        "ratio",
    )

    def __init__(self, rid: str, t: TraceRequest, tier: Tier) -> None:
        self.rid = rid
        self.tier = tier.name
        self.ttft_slo = tier.ttft_ms
        self.tpot_slo = tier.tpot_ms
        self.weight = tier.weight
        self.arrival = t.arrival_ms
        self.prompt = t.prompt_tokens
        self.output = t.output_tokens
        self.prefill_done = 0
        self.first_token: float | None = None
        self.finish: float | None = None
        self.group: _Group | None = None
        self.join_step = 0
        self.base_gen = 0
        self.error: str | None = None
        self.in_prefill = False
        self.kv_tokens = 0  # KV reserved on its group (prompt + output, reserved up front: no preemption)
        self.deadline = t.arrival_ms + tier.ttft_ms  # TTFT deadline: prefill order is EDF
        self.path_ms = 0.0  # service model: the client sees its tokens this much later
        self.stalled = False  # service model: ... and all at once
        self.ratio = 1.0  # service model: its decode steps' slowdown

    def generated(self) -> int:
        if self.first_token is None:
            return 0
        if self.group is None or self.group.running.get(self) is None:
            return self.base_gen
        return self.base_gen + self.group.step - self.join_step

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.rid,
            tier=self.tier,
            ttft_ms=self.ttft_slo,
            tpot_ms=self.tpot_slo,
            weight=self.weight,
            arrival_ms=self.arrival,
            prompt_tokens=self.prompt,
            max_tokens=self.output,
            output_tokens=self.generated(),
            first_token_ms=self.first_token,
            group_id=None if self.group is None else self.group.gid,
        )


def _by_deadline(r: _Req) -> float:
    return r.deadline


class _Group:
    __slots__ = (
        "gid",
        "node",
        "start",
        "tp",
        "role",
        "cost",
        "waiting",
        "prefilling",
        "running",
        "finish_heap",
        "step",
        "ctx_base",
        "busy",
        "paused_until",
        "kv_total",
        "kv_used",
        "version",
        "retired",
        "seq",
        "tpot_counts",
    )

    def __init__(
        self, node: _Node, start: int, tp: int, role: str, cost: CostModel, now: float, paused_until: float
    ) -> None:
        self.gid = group_id_of(node.node_id, start, tp)
        self.node = node
        self.start, self.tp, self.role = start, tp, role
        self.cost = cost
        self.waiting: list[tuple[float, int, _Req]] = []  # (TTFT deadline, seq, req): EDF
        self.prefilling: list[_Req] = []
        self.running: dict[_Req, int] = {}  # req -> step index of its last token
        self.finish_heap: list[tuple[int, int, _Req]] = []
        self.step = 0
        self.ctx_base = 0  # sum over running of (prompt + base_gen - join_step)
        self.busy = False
        self.paused_until = paused_until
        self.kv_total = cost.kv_capacity_tokens(tp)
        self.kv_used = 0
        self.version = 0
        self.retired = False
        self.seq = 0
        self.tpot_counts: dict[float, int] = {}  # TPOT target -> running requests with it (tightest = min)

    def add_running_tpot(self, tpot_ms: float) -> None:
        self.tpot_counts[tpot_ms] = self.tpot_counts.get(tpot_ms, 0) + 1

    def drop_running_tpot(self, tpot_ms: float) -> None:
        left = self.tpot_counts[tpot_ms] - 1
        if left:
            self.tpot_counts[tpot_ms] = left
        else:
            del self.tpot_counts[tpot_ms]

    @property
    def healthy(self) -> bool:
        return self.kv_total > 0

    def view(self, block: int) -> GroupView:
        return GroupView(
            group_id=self.gid,
            devices=tuple(range(self.start, self.start + self.tp)),
            tp=self.tp,
            role=self.role,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.prefilling),
            kv_blocks_free=max(self.kv_total - self.kv_used, 0) // block,
            kv_blocks_total=self.kv_total // block,
            healthy=self.healthy,
            draining=False,
        )


class _Node:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.groups: list[_Group] = []
        self.last_reconfig_ms: float | None = None


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
        self.nodes = [_Node(f"n{i}") for i in range(config.num_nodes)]
        self.reqs: list[_Req] = []
        self.live: dict[str, _Req] = {}
        self.coordinator_queue: list[_Req] = []
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
    def _node_view(self, node: _Node) -> NodeView:
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

    def _group(self, gid: str) -> _Group | None:
        for n in self.nodes:
            for g in n.groups:
                if g.gid == gid:
                    return g
        return None

    # -- topology ------------------------------------------------------------------------------------------
    def _build(self, node: _Node, topo: Topology, now: float, pause_ms: float) -> list[_Group]:
        topo.validate(self.config.devices_per_node, self.config.min_tp, self.config.max_tp)
        keep = {(g.start, g.tp, g.role): g for g in node.groups}
        new_groups, created = [], []
        for spec in topo.groups:
            g = keep.pop((spec.start, spec.tp, spec.role), None)
            if g is None:
                g = _Group(node, spec.start, spec.tp, spec.role, self.cost, now, now + pause_ms)
                created.append(g)
            new_groups.append(g)
        for g in keep.values():
            g.retired = True
            g.version += 1
        node.groups = new_groups
        self.topologies.append((now, node.node_id, str(topo)))
        self.layouts.append((now, node.node_id, topo))
        return created

    def _reconfigure(self, node: _Node, topo: Topology) -> list[Event]:
        now = self.sim.now_ms
        old = {(g.start, g.tp, g.role): g for g in node.groups}
        changed = [g for key, g in old.items() if key not in {(s.start, s.tp, s.role) for s in topo.groups}]
        moving: list[_Req] = []
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
            r.base_gen = r.generated()
            if r.group is not None and r in r.group.running:
                g_old = r.group
                g_old.ctx_base -= r.prompt + (r.base_gen - (g_old.step - r.join_step)) - r.join_step
                del g_old.running[r]
                g_old.drop_running_tpot(r.tpot_slo)
            if r.group is not None:
                r.group.kv_used -= r.kv_tokens
            r.kv_tokens = 0
            r.in_prefill = False
            r.group = None
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
        r = _Req(f"r{index}", t, tier)
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
        self, r: _Req, decode: bool, snap: ClusterSnapshot | None = None, ready_at: float | None = None
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

    def _join_decode(self, g: _Group, r: _Req, ready_at: float | None = None) -> list[Event]:
        now = self.sim.now_ms
        if ready_at is not None and ready_at > now:
            return [(ready_at, self._join_decode_ev, (g, r, g.version))]
        return self._join_decode_now(g, r)

    def _join_decode_ev(self, sim: Simulator, payload: tuple) -> list[Event]:
        g, r, version = payload
        if g.retired or g.version != version:
            return self._place(r, decode=True)
        return self._join_decode_now(g, r)

    def _join_decode_now(self, g: _Group, r: _Req) -> list[Event]:
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

    def _finish(self, r: _Req, now: float) -> list[Event]:
        r.finish = now
        if r.group is not None:
            r.group.kv_used -= r.kv_tokens
        r.kv_tokens = 0
        self.live.pop(r.rid, None)
        return []

    # -- engine steps --------------------------------------------------------------------------------------
    def _kick(self, g: _Group) -> list[Event]:
        if g.busy or g.retired:
            return []
        now = self.sim.now_ms
        if g.paused_until > now:
            g.busy = True
            return [(g.paused_until, self._resume, (g, g.version))]
        c = self.config
        n_dec = len(g.running) if g.role != "prefill" else 0
        dec_ctx = (g.ctx_base + n_dec * g.step) if n_dec else 0
        pre = sorted(g.prefilling, key=_by_deadline)  # a copy: admissions below append to g.prefilling
        if g.role == "prefill":
            budget = c.prefill_batch_tokens
        elif g.role == "hybrid":
            # The chunk attends to the prompt tokens already prefilled: the head of the EDF line's.
            head = pre[0] if pre else None
            if g.waiting and (head is None or g.waiting[0][2].deadline < head.deadline):
                head = g.waiting[0][2]
            budget = self._hybrid_budget(g, n_dec, dec_ctx + (head.prefill_done if head is not None else 0))
            if c.decode_tokens_in_budget:
                budget = max(budget - n_dec, 0)
        else:
            budget = 0
        # Prefill work in earliest-TTFT-deadline order over both the requests already part-way through their
        # prefill and the waiting ones: an interactive arrival is not stuck behind a long background prompt's
        # remaining chunks (those keep their KV and resume later).
        planned: list[tuple[_Req, int]] = []
        tokens = 0
        i = 0
        take_waiting = True
        while tokens < budget:
            p = pre[i] if i < len(pre) else None
            w = g.waiting[0][2] if take_waiting and g.waiting else None
            if w is not None and (p is None or w.deadline < p.deadline):
                need = w.prompt + w.output
                if g.kv_used + need > g.kv_total or len(g.running) + len(g.prefilling) >= c.max_batch:
                    take_waiting = False
                    continue
                heapq.heappop(g.waiting)
                g.kv_used += need
                w.kv_tokens = need
                w.in_prefill = True
                g.prefilling.append(w)
                r = w
            elif p is not None:
                i += 1
                r = p
            else:
                break
            n = min(r.prompt - r.prefill_done, budget - tokens)
            planned.append((r, n))
            tokens += n
        if not planned and n_dec == 0:
            return []
        ctx = dec_ctx + sum(r.prefill_done + n for r, n in planned)
        step_ms = g.cost.step_time_ms(g.tp, n_dec + len(planned), n_dec + tokens, ctx)
        if self.service is not None and not planned:  # decode-only steps; see sim/service.py for prefill
            step_ms *= sum(r.ratio for r in g.running) / n_dec  # O(batch): only simulations with a service model
        g.busy = True
        return [(now + step_ms, self._step_done, (g, g.version, planned))]

    def _hybrid_budget(self, g: _Group, n_dec: int, dec_ctx: int) -> int:
        """Prefill tokens this hybrid step may carry (see ClusterConfig.tpot_aware_chunks)."""
        c = self.config.chunk_tokens
        if not self.config.tpot_aware_chunks or n_dec == 0:
            return c
        tpot = min(g.tpot_counts)
        floor = min(self.config.min_chunk_tokens, c)
        while c > floor and g.cost.step_time_ms(g.tp, n_dec + 1, n_dec + c, dec_ctx + c) > tpot:
            c = max(c // 2, floor)
        return c

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

    def _handoff(self, r: _Req, src: _Group) -> list[Event]:
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
        records = [self._record(r) for r in self.reqs]
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

    def _record(self, r: _Req) -> RequestRecord:
        done = r.finish is not None and r.error is None
        if r.path_ms or r.stalled:  # service model: the client sees every token path_ms later (all at once)
            first = None if r.first_token is None else r.first_token + r.path_ms
            finish = first if r.stalled else None if r.finish is None else r.finish + r.path_ms
            return RequestRecord(
                request_id=r.rid,
                tier=r.tier,
                ttft_slo_ms=r.ttft_slo,
                tpot_slo_ms=r.tpot_slo,
                weight=r.weight,
                send_ms=r.arrival,
                first_token_ms=first,
                finish_ms=finish if done else None,
                output_tokens=r.output if done else r.generated(),
                prompt_tokens=r.prompt,
                error=r.error,
            )
        return RequestRecord(
            request_id=r.rid,
            tier=r.tier,
            ttft_slo_ms=r.ttft_slo,
            tpot_slo_ms=r.tpot_slo,
            weight=r.weight,
            send_ms=r.arrival,
            first_token_ms=r.first_token,
            finish_ms=r.finish if done else None,
            output_tokens=r.output if done else r.generated(),
            prompt_tokens=r.prompt,
            error=r.error,
        )


def run_cluster(policy: str, config: ClusterConfig, workload: list[TraceRequest]) -> ClusterResult:
    return ClusterSim(policy, config, workload).run()


__all__ = ["ClusterConfig", "ClusterResult", "ClusterSim", "run_cluster"]
