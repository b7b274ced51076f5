"""Build the policy's read-only ClusterSnapshot from the coordinator's membership tables.

Times are milliseconds on the coordinator's monotonic clock (the policy only compares them).
"""

from __future__ import annotations

from collections import deque

from nitsum.policy.snapshot import ArrivalStats, ClusterSnapshot, GroupView, NodeView, RequestView
from nitsum_services.coordinator.membership import Membership

ROLE_FOR_POLICY = {"prefill": "prefill", "decode": "decode", "hybrid": "hybrid"}


ARRIVAL_WINDOW_MS = 5000.0


class ArrivalWindow:
    """Arrivals of the last few seconds per tier (what keeps coming, not only what is queued)."""

    def __init__(self, window_ms: float = ARRIVAL_WINDOW_MS) -> None:
        self.window_ms = window_ms
        self._events: deque[tuple[float, str, float, float, float, int, int]] = deque()

    def add(self, now_ms: float, tier: str, ttft_ms: float, tpot_ms: float, weight: float, prompt_tokens: int, max_tokens: int) -> None:
        self._events.append((now_ms, tier, ttft_ms, tpot_ms, weight, prompt_tokens, max_tokens))

    def stats(self, now_ms: float) -> tuple[ArrivalStats, ...]:
        while self._events and now_ms - self._events[0][0] > self.window_ms:
            self._events.popleft()
        by_tier: dict[str, list] = {}
        for event in self._events:
            by_tier.setdefault(event[1], []).append(event)
        return tuple(
            ArrivalStats.measure(tier, self.window_ms, events[-1][2], events[-1][3], events[-1][4], [(e[5], e[6]) for e in events])
            for tier, events in sorted(by_tier.items())
        )


def fitting_max_tp(num_devices: int, max_tp: int) -> int:
    """The largest TP level up to `max_tp` whose aligned groups tile `num_devices` (halving until it divides)."""
    while max_tp > 1 and num_devices % max_tp:
        max_tp //= 2
    return max_tp


def build_snapshot(members: Membership, now_ms: float, max_tp: int, min_tp: int, device_kind: str, last_reconfig_ms: dict[str, float] | None = None, arrivals: tuple[ArrivalStats, ...] = ()) -> ClusterSnapshot:
    nodes: dict[str, list] = {}
    seen_groups: set[str] = set()
    # One view per group, from its leader (it holds the group's queue and KV numbers).
    for record in sorted(members.workers.values(), key=lambda r: not r.stats.leader):
        s = record.stats
        if s.group_id in seen_groups:
            continue
        seen_groups.add(s.group_id)
        start = s.device_index - s.device_index % max(s.tp, 1)
        group = GroupView(
            group_id=s.group_id,
            devices=tuple(range(start, start + s.tp)),
            tp=s.tp,
            role=ROLE_FOR_POLICY.get(s.role, "hybrid"),
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_blocks_free=s.kv_blocks_free,
            kv_blocks_total=s.kv_blocks_total,
            healthy=s.state in ("ready", "draining"),
            draining=not record.routable,
        )
        nodes.setdefault(s.node_id, []).append(group)
    node_views = []
    for node_id, groups in sorted(nodes.items()):
        groups.sort(key=lambda g: g.start)
        num_devices = max(g.start + g.tp for g in groups)
        # A node with missing devices (a dead worker) still gets a contiguous, aligned view of what is left.
        node_max_tp = fitting_max_tp(num_devices, max_tp)
        node_views.append(
            NodeView(
                node_id=node_id,
                num_devices=num_devices,
                min_tp=min(min_tp, node_max_tp),
                max_tp=node_max_tp,
                groups=tuple(groups),
                device_kind=device_kind,
                last_reconfig_ms=(last_reconfig_ms or {}).get(node_id),
            )
        )
    requests = []
    for req in members.requests.values():
        if req.view is None:
            continue
        group_id = members.workers[req.worker_id].stats.group_id if req.worker_id in members.workers else None
        requests.append(RequestView(**{**req.view.__dict__, "group_id": group_id}))
    return ClusterSnapshot(now_ms=now_ms, nodes=tuple(node_views), requests=tuple(requests), arrivals=arrivals)
