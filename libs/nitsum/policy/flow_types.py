"""The flow vocabulary of stage-aware flow scheduling (flows.py): `Stage`, the level → DSCP table, `FlowSpec`,
`FlowState`, `FlowStats`, and the `FlowScheduler` protocol that RMLQ and every baseline implement. Stdlib only."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


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
    def prune(
        self,
        now_ms: float,
        est_delay_ms: Mapping[str, float],
        pending: Mapping[str, tuple[str, float]] | None = None,
    ) -> list[str]: ...
    def unprune(self, request_id: str) -> None: ...
    def state(self, flow_id: str) -> FlowState | None: ...
