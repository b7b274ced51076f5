"""Nuska stage-aware flow scheduling: flows, the scheduler protocol, and the RMLQ policy.

ALGORITHMS.md §2 and reference/nuska-paper.txt §4. Owns: `Stage`, `FlowSpec`, `FlowState`, `FlowStats`,
the `FlowScheduler` protocol that RMLQ and every baseline (`flow_baselines`) implement, MLU with geometric
promotion thresholds, RLI, cross-stage arbitration, the level → DSCP table, and `RmlqScheduler`.

Levels: K queues, P1 highest. P1 is reserved for explicit-deadline flows (stages 3 and M) whose MLU passed
the top threshold Q_1; implicit flows (stages 1 and 2) live in P2 … PK (RLI 0 → P2). Flows are only ever
promoted (never demoted), and only when their unit crosses a layer boundary — or, for explicit flows of a
unit that is not computing (prefill done, a migration), every `reevaluate_interval_ms`.

Two views of one decision: `priorities()` is the K-level queue of each flow (what goes on the wire as
DSCP); `service_keys()` is the host-side strict order (ascending; flows with equal keys share fairly),
whose first element is always the level. All times are ms on the caller's clock; sizes are bytes;
bandwidths are bits/s. Stdlib only; never reads the clock.
"""

from __future__ import annotations

import enum
import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from nitsum.policy.flow_order import RequestLoad, prune_overload, robust_effective_deadline


class Stage(enum.Enum):
    KV_REUSE = "1"  # stage 1: fetch of cached prefix blocks; implicit deadline (before target layer)
    COLLECTIVE = "2"  # stage 2: all-reduce / all-to-all blocking the next layer; implicit deadline
    P2D = "3"  # stage 3: prefill → decode KV; explicit deadline (the TTFT deadline)
    MIGRATION = "M"  # TP-transition KV migration; explicit deadline (the planned cutover)

    @property
    def explicit(self) -> bool:
        return self in (Stage.P2D, Stage.MIGRATION)


# Level → DSCP. Standard per-hop behaviours in decreasing precedence: EF, AF41, AF31, AF21, AF11,
# default (0), CS1 (legacy lower effort) and LE (RFC 8622, 1) for the most deferred level.
_DSCP_LADDER: tuple[int, ...] = (46, 34, 26, 18, 10, 0, 8)
DSCP_LE = 1


def dscp_table(num_levels: int) -> dict[int, int]:
    """Default level → DSCP for K levels (2 ≤ K ≤ 8): the top K−1 rungs of the ladder, PK = LE."""
    if not 2 <= num_levels <= len(_DSCP_LADDER) + 1:
        raise ValueError(f"no default DSCP table for {num_levels} levels; pass one explicitly")
    table = {lvl: _DSCP_LADDER[lvl - 1] for lvl in range(1, num_levels)}
    table[num_levels] = DSCP_LE
    return table


DSCP_TABLE: dict[int, int] = dscp_table(8)


def tos_for_dscp(dscp: int) -> int:
    """The IP_TOS byte carrying a DSCP (the low two bits are ECN, left 0)."""
    assert 0 <= dscp < 64, f"DSCP is 6 bits, got {dscp}"
    return dscp << 2


@dataclass(frozen=True)
class FlowSpec:
    """One transfer, as submitted. Explicit stages need `deadline_ms`; implicit ones `target_layer`."""

    flow_id: str
    request_id: str
    unit_id: str  # the batch / prefill unit that owns the flow (layer boundaries are per unit)
    stage: Stage
    size_bytes: int
    src: str
    dst: str
    path: tuple[str, ...] = ()  # link ids; empty = one default link
    target_layer: int | None = None  # implicit deadline: needed before this layer runs
    deadline_ms: float | None = None  # explicit deadline (absolute, caller's clock)
    request_deadlines_ms: tuple[float, ...] = ()  # TTFT deadlines of the unit's requests, for RED
    request_deadline_ms: float | None = None  # TTFT deadline of `request_id` itself, for pruning

    def __post_init__(self) -> None:
        if self.size_bytes < 0:
            raise ValueError(f"flow {self.flow_id}: size_bytes must be >= 0, got {self.size_bytes}")
        if self.stage.explicit and self.deadline_ms is None:
            raise ValueError(f"flow {self.flow_id}: stage {self.stage.value} needs deadline_ms")
        if self.stage is Stage.KV_REUSE and self.target_layer is None:
            raise ValueError(f"flow {self.flow_id}: stage 1 needs target_layer")


@dataclass(frozen=True)
class FlowState:
    """A read-only snapshot of one active flow."""

    flow_id: str
    request_id: str
    unit_id: str
    stage: Stage
    remaining_bytes: int
    level: int
    current_layer: int  # of the owning unit (-1 before its first layer boundary)
    rli: int | None  # implicit flows only
    mlu: float | None  # explicit flows only, as of the last evaluation
    pruned: bool


@dataclass
class FlowStats:
    """Counters the service exports (nitsum_flow_permits_total{stage,level}, bytes, promotions, pruned).

    A permit is granted whenever a flow is assigned a level: once on arrival and once per promotion.
    """

    permits: dict[tuple[str, int], int] = field(default_factory=dict)  # (stage value, level) -> count
    bytes_by_stage: dict[str, int] = field(default_factory=dict)  # stage value -> bytes sent
    promotions: int = 0
    pruned_requests: int = 0

    def permit(self, stage: Stage, level: int) -> None:
        key = (stage.value, level)
        self.permits[key] = self.permits.get(key, 0) + 1

    def sent(self, stage: Stage, num_bytes: int) -> None:
        if num_bytes > 0:
            self.bytes_by_stage[stage.value] = self.bytes_by_stage.get(stage.value, 0) + num_bytes


class FlowScheduler(Protocol):
    """What RMLQ and every baseline implement; the simulator and the transfer agent drive it."""

    name: str
    num_levels: int
    stats: FlowStats

    def on_arrival(self, flow: FlowSpec, now_ms: float) -> None: ...
    def on_progress(self, flow_id: str, remaining_bytes: int, now_ms: float) -> None: ...
    def on_layer_boundary(self, unit_id: str, current_layer: int, now_ms: float) -> None: ...
    def on_unit_done(self, unit_id: str, now_ms: float) -> None: ...
    def on_complete(self, flow_id: str, now_ms: float) -> None: ...
    def on_tick(self, now_ms: float) -> None: ...
    def priorities(self, now_ms: float) -> dict[str, int]: ...
    def service_keys(self, now_ms: float) -> dict[str, tuple[float, ...]]: ...
    def rates(self, now_ms: float, link_bandwidth_bps: Mapping[str, float]) -> dict[str, float] | None: ...
    def order(self) -> list[str]: ...
    def prune(self, now_ms: float, est_delay_ms: Mapping[str, float]) -> list[str]: ...
    def state(self, flow_id: str) -> FlowState | None: ...


@dataclass(frozen=True)
class RmlqConfig:
    num_levels: int = 8  # K
    e: float = 4.0  # threshold ratio E
    u: float = 0.5  # threshold scale U: Q_i = E^(-i) · U, i = 1 … K−1
    reevaluate_interval_ms: float = 1.0  # explicit flows of units not computing
    default_bandwidth_bps: float = 100e9  # links not listed in link_bandwidth_bps
    link_bandwidth_bps: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_levels < 2:
            raise ValueError("RMLQ needs at least 2 levels (P1 is reserved for explicit flows)")
        if self.e <= 1.0 or self.u <= 0.0:
            raise ValueError(f"need E > 1 and U > 0, got E={self.e} U={self.u}")
        if self.reevaluate_interval_ms <= 0.0 or self.default_bandwidth_bps <= 0.0:
            raise ValueError("reevaluate_interval_ms and default_bandwidth_bps must be > 0")

    def thresholds(self) -> tuple[float, ...]:
        """Q_1 > Q_2 > … > Q_{K−1}: an MLU at or above Q_i puts an explicit flow at level i or higher."""
        return tuple(self.e ** (-i) * self.u for i in range(1, self.num_levels))


def level_for_mlu(mlu: float, thresholds: tuple[float, ...]) -> int:
    """The level whose threshold the MLU has passed (1 = past Q_1); below every threshold → K."""
    for i, q in enumerate(thresholds, start=1):
        if mlu >= q:
            return i
    return len(thresholds) + 1


def minimal_link_utilization(remaining_bytes: int, time_left_ms: float, bottleneck_bps: float, rho: float) -> float:
    """MLU = size_rem / (time_rem · B · (1 − ρ)); > 1 means the deadline is infeasible."""
    if remaining_bytes <= 0:
        return 0.0
    effective_bps = bottleneck_bps * (1.0 - rho)
    if time_left_ms <= 0.0 or effective_bps <= 0.0:
        return math.inf
    return (remaining_bytes * 8.0) / (time_left_ms / 1000.0 * effective_bps)


def relative_layer_index(target_layer: int, current_layer: int) -> int:
    return max(target_layer - current_layer, 0)


class _Flow:
    """Mutable per-flow record (internal); `FlowState` is its public snapshot."""

    __slots__ = ("spec", "remaining", "level", "rli", "mlu", "seq", "pruned", "anchor_ms", "timer_gen")

    def __init__(self, spec: FlowSpec, seq: int) -> None:
        self.spec = spec
        self.remaining = spec.size_bytes
        self.level = 0
        self.rli: int | None = None
        self.mlu: float | None = None
        self.seq = seq
        self.pruned = False
        self.anchor_ms = 0.0  # origin of this flow's periodic re-evaluation grid
        self.timer_gen = 0  # bumps on every re-arm: older heap entries are stale


class _Unit:
    __slots__ = ("unit_id", "flows", "layer", "computing", "red", "seq", "deadlines")

    def __init__(self, unit_id: str, seq: int) -> None:
        self.unit_id = unit_id
        self.flows: set[str] = set()
        self.layer = -1
        self.computing = False
        self.red = math.inf
        self.seq = seq
        self.deadlines: tuple[float, ...] = ()


class FlowTable:
    """Bookkeeping shared by RMLQ and the baselines: flows, units, σ by RED, stats, pruning.

    Subclasses decide `_key(flow)` (the service key; its first element is the level) and may react
    to layer boundaries. Every handler touches only the flows of one unit or one flow, so the decision
    time per event does not grow with the number of active flows (σ insertion is a C-level memmove).
    """

    name = "table"

    def __init__(self, num_levels: int) -> None:
        self.num_levels = num_levels
        self.stats = FlowStats()
        self._flows: dict[str, _Flow] = {}
        self._units: dict[str, _Unit] = {}
        self._keys: dict[str, tuple[float, ...]] = {}
        self._levels: dict[str, int] = {}
        self._sigma: list[tuple[float, int, str]] = []  # (RED, unit seq, unit id), sorted
        self._seq = 0
        self._pruned_requests: set[str] = set()

    # ---- events -------------------------------------------------------------------------
    def on_arrival(self, flow: FlowSpec, now_ms: float) -> None:
        assert flow.flow_id not in self._flows, f"flow {flow.flow_id} submitted twice"
        self.on_tick(now_ms)
        self._seq += 1
        rec = _Flow(flow, self._seq)
        unit = self._unit(flow.unit_id)
        if not unit.flows:
            self._sigma_add(unit)
        unit.flows.add(flow.flow_id)
        self._flows[flow.flow_id] = rec
        if flow.request_deadlines_ms and flow.request_deadlines_ms != unit.deadlines:
            self._set_unit_deadlines(unit, flow.request_deadlines_ms)
        elif not unit.deadlines and flow.stage.explicit and unit.red == math.inf:
            self._set_unit_deadlines(unit, (flow.deadline_ms,))  # type: ignore[arg-type]
        if flow.request_id in self._pruned_requests:
            rec.pruned = True
        self._admit(rec, unit, now_ms)

    def on_progress(self, flow_id: str, remaining_bytes: int, now_ms: float) -> None:
        rec = self._flows.get(flow_id)
        if rec is None:
            return  # progress racing a completion is an expected outcome, not an error
        assert 0 <= remaining_bytes <= rec.remaining, f"flow {flow_id}: remaining bytes grew"
        self.stats.sent(rec.spec.stage, rec.remaining - remaining_bytes)
        rec.remaining = remaining_bytes
        self._progressed(rec, now_ms)
        self.on_tick(now_ms)

    def on_layer_boundary(self, unit_id: str, current_layer: int, now_ms: float) -> None:
        self.on_tick(now_ms)
        unit = self._unit(unit_id)
        unit.layer = max(unit.layer, current_layer)
        unit.computing = True
        for fid in unit.flows:
            self._reevaluate(self._flows[fid], unit, now_ms)

    def set_unit_deadlines(self, unit_id: str, deadlines_ms: tuple[float, ...], now_ms: float) -> None:
        """The TTFT deadlines of a unit's requests (a worker's layer report): RED and σ follow them."""
        self.on_tick(now_ms)
        unit = self._units.get(unit_id)
        ds = tuple(sorted(deadlines_ms))
        if unit is not None and ds and ds != unit.deadlines:
            self._set_unit_deadlines(unit, ds)

    def on_unit_done(self, unit_id: str, now_ms: float) -> None:
        """The unit's compute finished: its explicit flows now move on the periodic timer."""
        self.on_tick(now_ms)
        unit = self._units.get(unit_id)
        if unit is None:
            return
        unit.computing = False
        if not unit.flows:
            del self._units[unit_id]
            return
        for fid in unit.flows:
            self._unit_released(self._flows[fid], now_ms)

    def on_complete(self, flow_id: str, now_ms: float) -> None:
        rec = self._flows.pop(flow_id, None)
        if rec is None:
            return
        self.stats.sent(rec.spec.stage, rec.remaining)
        self._keys.pop(flow_id, None)
        self._levels.pop(flow_id, None)
        unit = self._units[rec.spec.unit_id]
        unit.flows.discard(flow_id)
        if not unit.flows:
            self._sigma_remove(unit)
            if not unit.computing:
                del self._units[unit.unit_id]
        self.on_tick(now_ms)

    def on_tick(self, now_ms: float) -> None:
        """Time passed; schedulers with timers act here (called by every handler)."""

    # ---- views --------------------------------------------------------------------------
    def priorities(self, now_ms: float) -> dict[str, int]:
        self.on_tick(now_ms)
        return dict(self._levels)

    def service_keys(self, now_ms: float) -> dict[str, tuple[float, ...]]:
        self.on_tick(now_ms)
        return dict(self._keys)

    def rates(self, now_ms: float, link_bandwidth_bps: Mapping[str, float]) -> dict[str, float] | None:
        return None

    def order(self) -> list[str]:
        return [u for _, _, u in self._sigma]

    def state(self, flow_id: str) -> FlowState | None:
        rec = self._flows.get(flow_id)
        if rec is None:
            return None
        return FlowState(
            flow_id=flow_id,
            request_id=rec.spec.request_id,
            unit_id=rec.spec.unit_id,
            stage=rec.spec.stage,
            remaining_bytes=rec.remaining,
            level=rec.level,
            current_layer=self._units[rec.spec.unit_id].layer,
            rli=rec.rli,
            mlu=rec.mlu,
            pruned=rec.pruned,
        )

    def active_flows(self) -> int:
        return len(self._flows)

    def prune(self, now_ms: float, est_delay_ms: Mapping[str, float]) -> list[str]:
        """Baselines do not prune (Nuska's overload control is part of RMLQ)."""
        return []

    # ---- internals ----------------------------------------------------------------------
    def _unit(self, unit_id: str) -> _Unit:
        unit = self._units.get(unit_id)
        if unit is None:
            self._seq += 1
            unit = _Unit(unit_id, self._seq)
            self._units[unit_id] = unit
        return unit

    def _sigma_add(self, unit: _Unit) -> None:
        insort(self._sigma, (unit.red, unit.seq, unit.unit_id))

    def _sigma_remove(self, unit: _Unit) -> None:
        entry = (unit.red, unit.seq, unit.unit_id)
        i = bisect_left(self._sigma, entry)
        assert i < len(self._sigma) and self._sigma[i] == entry, f"unit {unit.unit_id} not in σ"
        del self._sigma[i]

    def _set_unit_deadlines(self, unit: _Unit, deadlines: tuple[float, ...]) -> None:
        in_sigma = bool(unit.flows)
        if in_sigma:
            self._sigma_remove(unit)
        unit.deadlines = deadlines
        unit.red = self._unit_rank_value(deadlines)
        if in_sigma:
            self._sigma_add(unit)
        for fid in unit.flows:
            rec = self._flows.get(fid)
            if rec is not None and rec.level:
                self._set_key(rec)

    def _unit_rank_value(self, deadlines: tuple[float, ...]) -> float:
        return robust_effective_deadline(deadlines)

    def _set_level(self, rec: _Flow, level: int) -> None:
        assert 1 <= level <= self.num_levels, f"level {level} outside 1..{self.num_levels}"
        if rec.level == level:
            return
        if rec.level and level < rec.level:
            self.stats.promotions += 1
        rec.level = level
        self.stats.permit(rec.spec.stage, level)
        self._set_key(rec)

    def _set_key(self, rec: _Flow) -> None:
        fid = rec.spec.flow_id
        if rec.pruned:
            self._keys.pop(fid, None)
            self._levels.pop(fid, None)
            return
        self._keys[fid] = self._key(rec)
        self._levels[fid] = rec.level

    # hooks
    def _admit(self, rec: _Flow, unit: _Unit, now_ms: float) -> None:
        raise NotImplementedError

    def _key(self, rec: _Flow) -> tuple[float, ...]:
        raise NotImplementedError

    def _progressed(self, rec: _Flow, now_ms: float) -> None:
        """Remaining bytes changed (SJF-like keys update here)."""

    def _reevaluate(self, rec: _Flow, unit: _Unit, now_ms: float) -> None:
        """The unit crossed a layer boundary."""

    def _unit_released(self, rec: _Flow, now_ms: float) -> None:
        """The unit's compute finished."""


class RmlqScheduler(FlowTable):
    """Nuska's Reverse Multi-Level Queue: defer, then promote at layer boundaries; RED order; pruning."""

    name = "rmlq"

    def __init__(self, config: RmlqConfig | None = None) -> None:
        self.config = config or RmlqConfig()
        super().__init__(self.config.num_levels)
        self._thresholds = self.config.thresholds()
        self._bandwidth_bps = dict(self.config.link_bandwidth_bps)
        self._rho: dict[str, float] = {}
        self._timer: list[tuple[float, int, str]] = []  # (due ms, timer gen, flow id): periodic MLU checks

    def set_link_load(self, link_id: str, rho: float, now_ms: float | None = None) -> None:
        """Fraction of the link already taken by higher levels (from the flow-scheduler service).

        Rare control-plane update: re-arms the timed flows (O(active flows)); takes effect at each flow's
        next check — layer boundary or grid tick — never as an immediate promotion."""
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"link load must be in [0, 1], got {rho}")
        self._rho[link_id] = rho
        self._rearm_all(now_ms)

    def set_link_bandwidth(self, link_id: str, bandwidth_bps: float, now_ms: float | None = None) -> None:
        if bandwidth_bps <= 0.0:
            raise ValueError(f"bandwidth must be > 0, got {bandwidth_bps}")
        self._bandwidth_bps[link_id] = bandwidth_bps
        self._rearm_all(now_ms)

    def _effective_bps(self, spec: FlowSpec) -> float:
        """Residual bandwidth B · (1 − ρ) of the path's bottleneck link."""
        default = self.config.default_bandwidth_bps
        if not spec.path:
            return default
        return min(self._bandwidth_bps.get(l, default) * (1.0 - self._rho.get(l, 0.0)) for l in spec.path)

    def mlu(self, spec: FlowSpec, remaining_bytes: int, now_ms: float) -> float:
        """MLU of a flow now, on its path's bottleneck."""
        assert spec.deadline_ms is not None
        return minimal_link_utilization(remaining_bytes, spec.deadline_ms - now_ms, self._effective_bps(spec), 0.0)

    def on_tick(self, now_ms: float) -> None:
        """Run the periodic MLU checks that are due. Each flow is armed only for the grid tick at which
        its MLU will first reach the next threshold (MLU only rises while a flow waits), so the cost is
        per promotion, not per flow per interval; progress only delays a crossing, and a check that
        fires early just re-arms."""
        timer = self._timer
        while timer and timer[0][0] <= now_ms:
            _, gen, fid = heapq.heappop(timer)
            rec = self._flows.get(fid)
            if rec is None or rec.timer_gen != gen:
                continue  # completed or re-armed since
            if self._units[rec.spec.unit_id].computing:
                continue  # its unit's layer boundaries drive it again
            self._promote_explicit(rec, now_ms)
            self._arm(rec, now_ms)

    def _arm(self, rec: _Flow, now_ms: float) -> None:
        rec.timer_gen += 1
        if rec.level <= 1 or rec.pruned:
            return  # P1 is the top: nothing left to promote
        assert rec.spec.deadline_ms is not None
        q = self._thresholds[rec.level - 2]  # reaching Q_{level-1} promotes to level − 1
        bps = self._effective_bps(rec.spec)
        if bps <= 0.0:
            cross_ms = now_ms
        else:
            cross_ms = rec.spec.deadline_ms - rec.remaining * 8000.0 / (q * bps)
        interval = self.config.reevaluate_interval_ms
        k = max(math.floor((now_ms - rec.anchor_ms) / interval) + 1, math.ceil((cross_ms - rec.anchor_ms) / interval))
        heapq.heappush(self._timer, (rec.anchor_ms + k * interval, rec.timer_gen, rec.spec.flow_id))

    def _rearm_all(self, now_ms: float | None) -> None:
        """Link bandwidth or load changed: crossings may come earlier, so re-arm every timed flow."""
        for rec in self._flows.values():
            if rec.spec.stage.explicit and not self._units[rec.spec.unit_id].computing:
                self._arm(rec, rec.anchor_ms if now_ms is None else now_ms)

    def prune(self, now_ms: float, est_delay_ms: Mapping[str, float]) -> list[str]:
        """Overload control on σ; `est_delay_ms`: request id → its estimated compute + comm delay.

        A request's deadline is its `request_deadline_ms`, else the earliest explicit deadline among its
        flows; requests with neither never miss. Pruned requests' flows leave `priorities()` (suppressed)
        and so do later flows of the same request.
        """
        self.on_tick(now_ms)
        deadline: dict[str, float] = {}
        unit_of: dict[str, str] = {}
        for rec in self._flows.values():
            rid = rec.spec.request_id
            if rec.pruned or rid not in est_delay_ms:
                continue
            d = rec.spec.request_deadline_ms
            if d is None and rec.spec.stage.explicit:
                d = rec.spec.deadline_ms
            unit_of[rid] = rec.spec.unit_id
            if d is not None:
                deadline[rid] = min(d, deadline.get(rid, math.inf))
        loads = [
            RequestLoad(rid, unit_of[rid], deadline.get(rid, math.inf), float(est_delay_ms[rid]))
            for rid in sorted(unit_of)
        ]
        pruned = prune_overload(self.order(), loads, now_ms)
        for rid in pruned:
            self._pruned_requests.add(rid)
        if pruned:
            victims = set(pruned)
            for rec in self._flows.values():
                if rec.spec.request_id in victims:
                    rec.pruned = True
                    self._set_key(rec)
        self.stats.pruned_requests += len(pruned)
        return pruned

    # ---- level rules --------------------------------------------------------------------
    def _implicit_level(self, rec: _Flow, unit: _Unit) -> int:
        spec = rec.spec
        if spec.stage is Stage.COLLECTIVE:
            rec.rli = 0  # blocks the next layer: the highest implicit level directly
        else:
            assert spec.target_layer is not None
            rec.rli = relative_layer_index(spec.target_layer, max(unit.layer, 0))
        return min(2 + rec.rli, self.num_levels)

    def _explicit_level(self, rec: _Flow, now_ms: float) -> int:
        rec.mlu = self.mlu(rec.spec, rec.remaining, now_ms)
        return level_for_mlu(rec.mlu, self._thresholds)

    def _promote_explicit(self, rec: _Flow, now_ms: float) -> None:
        self._set_level(rec, min(rec.level, self._explicit_level(rec, now_ms)))

    def _admit(self, rec: _Flow, unit: _Unit, now_ms: float) -> None:
        if rec.spec.stage.explicit:
            self._set_level(rec, self._explicit_level(rec, now_ms))
            if not unit.computing:
                rec.anchor_ms = now_ms
                self._arm(rec, now_ms)
        else:
            self._set_level(rec, self._implicit_level(rec, unit))

    def _reevaluate(self, rec: _Flow, unit: _Unit, now_ms: float) -> None:
        if rec.spec.stage.explicit:
            self._promote_explicit(rec, now_ms)
        else:
            self._set_level(rec, min(rec.level, self._implicit_level(rec, unit)))

    def _unit_released(self, rec: _Flow, now_ms: float) -> None:
        if rec.spec.stage.explicit:
            self._promote_explicit(rec, now_ms)
            rec.anchor_ms = now_ms
            self._arm(rec, now_ms)

    def _key(self, rec: _Flow) -> tuple[float, ...]:
        """Arbitration inside a level: implicit before explicit; implicit by RLI then σ (RED);
        explicit by deadline; arrival order last, so the host order is total."""
        if rec.spec.stage.explicit:
            assert rec.spec.deadline_ms is not None
            return (float(rec.level), 1.0, rec.spec.deadline_ms, 0.0, float(rec.seq))
        red = self._units[rec.spec.unit_id].red
        return (float(rec.level), 0.0, float(rec.rli or 0), red, float(rec.seq))
