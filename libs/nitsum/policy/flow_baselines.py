"""Baseline flow schedulers under the `FlowScheduler` interface: Fair Sharing, SJF, EDF, Karuna.

As the Nuska paper evaluates them (§6.1; ALGORITHMS.md §2.4): FS shares every link max-min; SJF serves
the smallest remaining size first; EDF serves explicit deadlines first and shares fairly among the rest;
Karuna gives deadline flows the minimal rate that meets their deadline and schedules the rest SJF.
None of them promotes at layer boundaries or prunes; `make_flow_scheduler(..., overload_check=True)` gives
one RMLQ's worst-case check and pruning, in its own unit order, for the breakdown of where RMLQ's gain comes
from. Levels for the wire: FS puts everything in one class (PK); SJF and Karuna map the remaining size to
levels geometrically (1 MiB · 4^i), the way commodity-switch SJF approximations do. Stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nitsum.policy.flow_table import FlowTable, _Flow, _Unit
from nitsum.policy.flow_types import Stage

SIZE_CLASS_BASE_BYTES = 1 << 20  # remaining sizes below this share the top size class
SIZE_CLASS_RATIO = 4


def size_class(remaining_bytes: int, num_classes: int) -> int:
    """0 for < 1 MiB, then one class per factor of 4, capped at num_classes − 1."""
    c, bound = 0, SIZE_CLASS_BASE_BYTES  # integer steps: no float rounding at exact powers
    while remaining_bytes >= bound and c < num_classes - 1:
        c += 1
        bound *= SIZE_CLASS_RATIO
    return c


class FairSharing(FlowTable):
    """Max-min fair sharing: one class for all flows; σ is arrival order."""

    name = "fs"

    def __init__(self, num_levels: int = 8) -> None:
        super().__init__(num_levels)

    def _unit_rank_value(self, deadlines: tuple[float, ...]) -> float:
        return 0.0  # σ by arrival (unit sequence number breaks the tie)

    def _admit(self, rec: _Flow, unit: _Unit, now_ms: float) -> None:
        self._set_level(rec, self.num_levels)

    def _key(self, rec: _Flow) -> tuple[float, ...]:
        return (float(rec.level),)


class _MinDeadlineOrder(FlowTable):
    def _unit_rank_value(self, deadlines: tuple[float, ...]) -> float:
        return min(deadlines) if deadlines else math.inf


class ShortestJobFirst(_MinDeadlineOrder):
    """Smallest remaining size first; equal sizes share."""

    name = "sjf"

    def __init__(self, num_levels: int = 8) -> None:
        super().__init__(num_levels)

    def _admit(self, rec: _Flow, unit: _Unit, now_ms: float) -> None:
        self._set_level(rec, 1 + size_class(rec.remaining, self.num_levels))

    def _progressed(self, rec: _Flow, now_ms: float) -> None:
        level = 1 + size_class(rec.remaining, self.num_levels)
        if level != rec.level:
            self._set_level(rec, level)
        else:
            self._set_key(rec)

    def _key(self, rec: _Flow) -> tuple[float, ...]:
        return (float(rec.level), float(rec.remaining))


class EarliestDeadlineFirst(_MinDeadlineOrder):
    """Explicit deadlines first (earliest first, level 1); implicit flows share fairly (level 2)."""

    name = "edf"

    def __init__(self, num_levels: int = 8) -> None:
        super().__init__(num_levels)

    def _admit(self, rec: _Flow, unit: _Unit, now_ms: float) -> None:
        self._set_level(rec, 1 if rec.spec.stage.explicit else 2)

    def _key(self, rec: _Flow) -> tuple[float, ...]:
        if rec.spec.stage.explicit:
            assert rec.spec.deadline_ms is not None
            return (1.0, rec.spec.deadline_ms)
        return (2.0, 0.0)


class Karuna(_MinDeadlineOrder):
    """Deadline flows at level 1, paced at the minimal rate meeting the deadline; the rest SJF below."""

    name = "karuna"

    def __init__(self, num_levels: int = 8) -> None:
        super().__init__(num_levels)

    def _sjf_level(self, rec: _Flow) -> int:
        return 2 + size_class(rec.remaining, self.num_levels - 1)

    def _admit(self, rec: _Flow, unit: _Unit, now_ms: float) -> None:
        self._set_level(rec, 1 if rec.spec.stage.explicit else self._sjf_level(rec))

    def _progressed(self, rec: _Flow, now_ms: float) -> None:
        if rec.spec.stage.explicit:
            return
        level = self._sjf_level(rec)
        if level != rec.level:
            self._set_level(rec, level)
        else:
            self._set_key(rec)

    def _key(self, rec: _Flow) -> tuple[float, ...]:
        if rec.spec.stage.explicit:
            return (1.0, 0.0)  # paced by rates(); they share level 1
        return (float(rec.level), float(rec.remaining))

    def rates(self, now_ms: float, link_bandwidth_bps: Mapping[str, float]) -> dict[str, float] | None:
        """Pacing rate (bits/s) of each deadline flow: remaining / time left, capped at its bottleneck.

        A flow past its deadline gets its bottleneck rate (Karuna then just finishes it as fast as it can).
        Flows not in the result are not paced.
        """
        out: dict[str, float] = {}
        for fid, rec in self._flows.items():
            spec = rec.spec
            if not spec.stage.explicit or rec.pruned:
                continue
            assert spec.deadline_ms is not None
            cap = min((link_bandwidth_bps.get(l, math.inf) for l in spec.path), default=math.inf)
            left_ms = spec.deadline_ms - now_ms
            need = math.inf if left_ms <= 0.0 else rec.remaining * 8.0 / (left_ms / 1000.0)
            out[fid] = min(need, cap)
        return out


BASELINES: dict[str, type[FlowTable]] = {
    "fs": FairSharing,
    "sjf": ShortestJobFirst,
    "edf": EarliestDeadlineFirst,
    "karuna": Karuna,
}

__all__ = [
    "BASELINES",
    "SCHEDULER_NAMES",
    "EarliestDeadlineFirst",
    "FairSharing",
    "Karuna",
    "ShortestJobFirst",
    "Stage",
    "make_flow_scheduler",
    "size_class",
]


SCHEDULER_NAMES: tuple[str, ...] = ("rmlq", *BASELINES)


def make_flow_scheduler(
    name: str,
    num_levels: int = 8,
    rmlq_e: float | None = None,
    rmlq_u: float | None = None,
    overload_check: bool | None = None,
) -> FlowTable:
    """A fresh scheduler by name: "rmlq" (RmlqConfig with K levels; E and U default to the paper's 4 and
    0.5) or a baseline (which has no thresholds: E and U are ignored). `overload_check`: whether `prune`
    runs the worst-case check (None: the scheduler's own default, on for RMLQ and off for the baselines)."""
    from nitsum.policy.flows import RmlqConfig, RmlqScheduler

    sched: FlowTable
    if name == "rmlq":
        extra = {k: v for k, v in (("e", rmlq_e), ("u", rmlq_u)) if v is not None}
        sched = RmlqScheduler(RmlqConfig(num_levels=num_levels, **extra))
    elif name in BASELINES:
        sched = BASELINES[name](num_levels)
    else:
        raise ValueError(f"unknown flow scheduler {name!r}; choose one of {', '.join(SCHEDULER_NAMES)}")
    if overload_check is not None:
        sched.overload_check = overload_check
    return sched
