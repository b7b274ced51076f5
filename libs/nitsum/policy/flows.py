"""Nuska stage-aware flow scheduling: flows, the scheduler protocol, and the RMLQ policy.

ALGORITHMS.md §2 and reference/nuska-paper.txt §4. Owns: `Stage`, `FlowSpec`, `FlowState`, `FlowStats`,
the `FlowScheduler` protocol that RMLQ and every baseline (`flow_baselines`) implement, MLU with geometric
promotion thresholds, RLI, cross-stage arbitration, the level → DSCP table, and `RmlqScheduler`
(the vocabulary lives in flow_types.py, the shared bookkeeping `FlowTable` in flow_table.py; both re-exported).

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

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from nitsum.policy.flow_table import FlowTable, _Flow, _Unit
from nitsum.policy.flow_types import (
    DSCP_LE,
    DSCP_TABLE,
    FlowScheduler,
    FlowSpec,
    FlowState,
    FlowStats,
    Stage,
    dscp_table,
    tos_for_dscp,
)

__all__ = [
    "DSCP_LE",
    "DSCP_TABLE",
    "FlowScheduler",
    "FlowSpec",
    "FlowState",
    "FlowStats",
    "FlowTable",
    "RmlqConfig",
    "RmlqScheduler",
    "Stage",
    "dscp_table",
    "level_for_mlu",
    "minimal_link_utilization",
    "relative_layer_index",
    "tos_for_dscp",
]


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


class RmlqScheduler(FlowTable):
    """Nuska's Reverse Multi-Level Queue: defer, then promote at layer boundaries; RED order; pruning."""

    name = "rmlq"
    overload_check = True  # Nuska prunes (paper §4.4.2)

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
