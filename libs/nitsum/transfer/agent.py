"""The pure half of a worker's transfer agent: flows waiting for their turn, in strict priority order.

Levels follow Nuska (`nitsum.policy.flows`): P1 is the highest priority, PK the lowest. Within a level,
flows leave in arrival order. A permit update may only promote a waiting flow (a smaller level number);
Nuska never demotes, so a larger level is ignored. Stdlib only, no clock, no I/O.
"""

from __future__ import annotations

import heapq


class PriorityFlowQueue:
    """Waiting flows; `pop` returns the one to send next: lowest level number, then earliest arrival."""

    def __init__(self) -> None:
        self._level: dict[str, int] = {}
        self._arrival: dict[str, int] = {}
        # (level, arrival, flow id); entries whose level is no longer the flow's current one are stale
        # and skipped on pop (a promotion pushes a fresh entry instead of re-heapifying).
        self._heap: list[tuple[int, int, str]] = []
        self._next_arrival = 0

    def __len__(self) -> int:
        return len(self._level)

    def __contains__(self, flow_id: str) -> bool:
        return flow_id in self._level

    def level(self, flow_id: str) -> int | None:
        return self._level.get(flow_id)

    def push(self, flow_id: str, level: int) -> None:
        assert flow_id not in self._level, f"flow {flow_id} is already queued"
        assert level >= 1, f"levels start at 1 (P1), got {level}"
        self._level[flow_id] = level
        self._arrival[flow_id] = self._next_arrival
        heapq.heappush(self._heap, (level, self._next_arrival, flow_id))
        self._next_arrival += 1

    def promote(self, flow_id: str, level: int) -> bool:
        """Move a waiting flow up to `level`; False when it is not waiting or would not move up."""
        current = self._level.get(flow_id)
        if current is None or level >= current:
            return False
        self._level[flow_id] = level
        heapq.heappush(self._heap, (level, self._arrival[flow_id], flow_id))
        return True

    def remove(self, flow_id: str) -> bool:
        self._arrival.pop(flow_id, None)
        return self._level.pop(flow_id, None) is not None

    def pop(self) -> tuple[str, int] | None:
        """(flow id, level) of the next flow to send, removed from the queue; None when empty."""
        while self._heap:
            level, _arrival, flow_id = heapq.heappop(self._heap)
            if self._level.get(flow_id) == level:
                del self._level[flow_id]
                del self._arrival[flow_id]
                return flow_id, level
        return None
