"""`FlowTable`: the bookkeeping RMLQ (flows.py) and the baselines (flow_baselines.py) share: flows, units, σ by
RED, stats, pruning. Stdlib only."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Mapping

from nitsum.policy.flow_order import RequestLoad, prune_overload, robust_effective_deadline
from nitsum.policy.flow_types import FlowSpec, FlowState, FlowStats

PRUNED_MEMORY = 10_000  # pruned request ids remembered (their later flows are suppressed)


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
    overload_check = False  # the worst-case check and pruning (`prune`); the baselines' default is off

    def __init__(self, num_levels: int) -> None:
        self.num_levels = num_levels
        self.stats = FlowStats()
        self._flows: dict[str, _Flow] = {}
        self._units: dict[str, _Unit] = {}
        self._keys: dict[str, tuple[float, ...]] = {}
        self._levels: dict[str, int] = {}
        self._sigma: list[tuple[float, int, str]] = []  # (RED, unit seq, unit id), sorted
        self._seq = 0
        # pruned request ids, oldest first (their later flows are suppressed); the oldest are forgotten past
        # PRUNED_MEMORY, and `unprune` takes one back
        self._pruned_requests: dict[str, None] = {}

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

    def prune(
        self,
        now_ms: float,
        est_delay_ms: Mapping[str, float],
        pending: Mapping[str, tuple[str, float]] | None = None,
    ) -> list[str]:
        """Overload control on σ, where `overload_check` is set (RMLQ by default; a baseline for the breakdown).

        `est_delay_ms`: request id → its estimated compute + comm delay.

        A request's deadline is its `request_deadline_ms`, else the earliest explicit deadline among its
        flows; requests with neither never miss. Pruned requests' flows leave `priorities()` (suppressed)
        and so do later flows of the same request. `pending`: request id → (unit id, TTFT deadline) of
        requests in a batch that has arrived but sent no flow yet (the check runs on batch arrival, paper
        §4.4.2); a unit with no flow here takes its place in σ by this scheduler's rank of those deadlines.
        """
        if not self.overload_check:
            return []
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
        for rid, (uid, d) in (pending or {}).items():
            if rid in est_delay_ms and rid not in unit_of and rid not in self._pruned_requests:
                unit_of[rid] = uid
                deadline[rid] = d
        loads = [
            RequestLoad(rid, unit_of[rid], deadline.get(rid, math.inf), float(est_delay_ms[rid]))
            for rid in sorted(unit_of)
        ]
        pruned = prune_overload(self._order_with(unit_of, deadline), loads, now_ms)
        for rid in pruned:
            self._pruned_requests[rid] = None
        while len(self._pruned_requests) > PRUNED_MEMORY:
            del self._pruned_requests[next(iter(self._pruned_requests))]
        if pruned:
            victims = set(pruned)
            for rec in self._flows.values():
                if rec.spec.request_id in victims:
                    rec.pruned = True
                    self._set_key(rec)
        self.stats.pruned_requests += len(pruned)
        return pruned

    def unprune(self, request_id: str) -> None:
        """Take back a prune whose request goes on after all (its worker kept it: the prune came after its first
        token, or it was re-submitted): its later flows are ranked as any other. (Its flows known at the prune
        were withdrawn then; the flow-scheduler forgets them.)"""
        self._pruned_requests.pop(request_id, None)

    def _order_with(self, unit_of: Mapping[str, str], deadline: Mapping[str, float]) -> list[str]:
        """σ, with the units of pending requests that have no flow merged in by this scheduler's rank of their
        deadlines (RED for RMLQ)."""
        known = {u for _, _, u in self._sigma}
        extra: dict[str, list[float]] = {}
        for rid, uid in unit_of.items():
            if uid not in known:
                extra.setdefault(uid, []).append(deadline.get(rid, math.inf))
        if not extra:
            return self.order()
        ranked = list(self._sigma) + [
            (self._unit_rank_value(tuple(ds)), math.inf, uid) for uid, ds in sorted(extra.items())
        ]
        ranked.sort(key=lambda e: (e[0], e[1], e[2]))
        return [u for _, _, u in ranked]

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
