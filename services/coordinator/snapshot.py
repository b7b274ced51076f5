"""Build the policy's read-only ClusterSnapshot from the coordinator's membership tables.

Times are milliseconds on the coordinator's monotonic clock (the policy only compares them).
"""

from __future__ import annotations

from nitsum.policy.snapshot import (
    ArrivalStats,
    ArrivalWindow,
    ClusterSnapshot,
    GroupView,
    NodeView,
    RequestView,
    assemble_snapshot,
)
from nitsum_services.coordinator.membership import Membership

ROLE_FOR_POLICY = {"prefill": "prefill", "decode": "decode", "hybrid": "hybrid"}


ARRIVAL_WINDOW_MS = 5000.0  # the shared nitsum.policy.snapshot.ArrivalWindow's default
ARRIVAL_REFRESH_MS = 50.0  # the window's figures are measured at most this often (see ArrivalWindow.refresh_ms)
__all__ = ["ARRIVAL_WINDOW_MS", "ArrivalWindow", "build_snapshot", "fitting_max_tp", "live_arrival_window"]


def live_arrival_window(boot_ms: float) -> ArrivalWindow:
    """The coordinator's arrival window: the simulator's (ClusterConfig.arrival_window_ms), counted from boot as
    the simulator counts from 0, so the first seconds are not under-counted. Shift detection (the simulator's
    load_shift_ms) stays off live for now: its settle rule would hold every change for 10 s after boot."""
    return ArrivalWindow(ARRIVAL_WINDOW_MS, started_ms=boot_ms, refresh_ms=ARRIVAL_REFRESH_MS)


def fitting_max_tp(num_devices: int, max_tp: int) -> int:
    """The largest TP level up to `max_tp` whose aligned groups tile `num_devices` (halving until it divides)."""
    while max_tp > 1 and num_devices % max_tp:
        max_tp //= 2
    return max_tp


def build_snapshot(
    members: Membership,
    now_ms: float,
    max_tp: int,
    min_tp: int,
    device_kind: str,
    last_reconfig_ms: dict[str, float] | None = None,
    arrivals: ArrivalWindow | tuple[ArrivalStats, ...] = (),
) -> ClusterSnapshot:
    """Groups from their leaders' heartbeats; requests from the coordinator's views, with the progress the
    workers report (membership.py). A group's running / waiting counts are its requests past / before their
    first token (the simulator's meaning); requests known only from a heartbeat (a coordinator restart) count
    as running."""
    counts = group_counts(members)
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
            num_running=counts.get(s.group_id, (0, 0))[0],
            num_waiting=counts.get(s.group_id, (0, 0))[1],
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
    return assemble_snapshot(now_ms, node_views, requests, arrivals=arrivals)


def group_counts(members: Membership) -> dict[str, tuple[int, int]]:
    """Group id -> (requests past their first token, requests before it)."""
    out: dict[str, list[int]] = {}
    for req in members.requests.values():
        record = members.workers.get(req.worker_id)
        if record is None:
            continue
        c = out.setdefault(record.stats.group_id, [0, 0])
        c[0 if req.view is None or req.view.first_token_ms is not None else 1] += 1
    return {g: (c[0], c[1]) for g, c in out.items()}
