"""Nuska inter-request order: Robust Effective Deadline (RED), the unit order σ and overload pruning.

ALGORITHMS.md §2.3 / paper §4.4.2. Pure functions over plain values (stdlib only); the RMLQ scheduler
in `nitsum.policy.flows` and the flow-scheduler service call them with their own snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def robust_effective_deadline(deadlines_ms: Iterable[float]) -> float:
    """RED of a batch: split its sorted deadlines at the largest gap into a tight and a loose part.

    RED = f · D_min(tight) + (1 − f) · D_min(loose), f = tight fraction. A few tight requests then
    move the batch's urgency only in proportion to their number (the "piggyback" effect). Ties between
    equal largest gaps split at the first one, so the result is deterministic. No deadlines → +inf.
    """
    ds = sorted(deadlines_ms)
    if not ds:
        return math.inf
    if len(ds) == 1:
        return ds[0]
    best_gap, split = -1.0, 1
    for i in range(1, len(ds)):
        gap = ds[i] - ds[i - 1]
        if gap > best_gap:
            best_gap, split = gap, i
    if best_gap <= 0.0:
        return ds[0]  # all deadlines equal: nothing to split
    f = split / len(ds)
    return f * ds[0] + (1.0 - f) * ds[split]


@dataclass(frozen=True)
class RequestLoad:
    """One request's share of the work in a feasibility check.

    `delay_ms` is the estimated compute + communication time this request adds to its unit (batch);
    units run one after another in σ, and a unit finishes when all its requests' work is done.
    """

    request_id: str
    unit_id: str
    deadline_ms: float
    delay_ms: float


def prune_overload(unit_order: Sequence[str], loads: Sequence[RequestLoad], now_ms: float) -> list[str]:
    """Overload pruning (the "black hole" effect): returns the pruned request ids, in pruning order.

    Walk σ accumulating delay; where the first request misses its deadline, prune the request that
    contributes most to the cumulative delay up to that point (ties: earliest in σ, then smallest id),
    and repeat until every remaining request is feasible. Requests of units not in `unit_order` are
    ignored. O(n²) worst case; it runs on batch arrival and departure only, not per event.
    """
    rank = {u: i for i, u in enumerate(unit_order)}
    live = sorted(
        (ld for ld in loads if ld.unit_id in rank),
        key=lambda ld: (rank[ld.unit_id], ld.request_id),
    )
    pruned: list[str] = []
    while True:
        victim = _first_violation_victim(live, now_ms)
        if victim is None:
            return pruned
        pruned.append(live[victim].request_id)
        del live[victim]


def _first_violation_victim(live: Sequence[RequestLoad], now_ms: float) -> int | None:
    """Index of the request to prune for the first missed deadline along σ, or None when all fit."""
    t_ms = now_ms
    i = 0
    n = len(live)
    while i < n:
        # One unit = a contiguous run in `live`: all its requests finish together.
        j = i
        while j < n and live[j].unit_id == live[i].unit_id:
            t_ms += live[j].delay_ms
            j += 1
        if any(live[k].deadline_ms < t_ms for k in range(i, j)):
            best = 0
            for k in range(1, j):
                if live[k].delay_ms > live[best].delay_ms:
                    best = k
            return best
        i = j
    return None
