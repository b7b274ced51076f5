"""The discrete-event core: one heap keyed by (time_ms, seq); handlers return the next events.

An event is `(time_ms, handler, payload)`. The simulator pops the earliest (ties: the order they were
scheduled, via a per-simulator sequence number, so runs are deterministic), calls `handler(sim, payload)`,
and pushes whatever events it returns. A handler never pushes directly and never reads a clock: the
simulated time is `sim.now_ms`. Cancellation is by version: a handler that may be superseded carries a
token in its payload and ignores itself when the token is stale (cheaper than deleting from a heap).

No id counter is global: sequence numbers, like everything else, live in one Simulator instance.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from typing import Any

Handler = Callable[["Simulator", Any], "Iterable[Event] | None"]
Event = tuple[float, Handler, Any]


class Simulator:
    """Runs events in (time, seq) order. `now_ms` only moves forward."""

    __slots__ = ("now_ms", "_heap", "_seq", "events_run", "wall_s")

    def __init__(self, start_ms: float = 0.0) -> None:
        self.now_ms = start_ms
        self._heap: list[tuple[float, int, Handler, Any]] = []
        self._seq = 0
        self.events_run = 0
        self.wall_s = 0.0

    def schedule(self, time_ms: float, handler: Handler, payload: Any = None) -> None:
        """Add one event (for setup code outside handlers; handlers return events instead)."""
        assert time_ms >= self.now_ms, f"event at {time_ms} ms is in the past (now {self.now_ms} ms)"
        self._seq += 1
        heapq.heappush(self._heap, (time_ms, self._seq, handler, payload))

    def schedule_all(self, events: Iterable[Event]) -> None:
        for t, h, p in events:
            self.schedule(t, h, p)

    @property
    def pending(self) -> int:
        return len(self._heap)

    def peek_ms(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run(self, until_ms: float = float("inf"), max_events: int | None = None) -> int:
        """Run events with time <= until_ms (or until the heap empties); returns how many ran."""
        heap = self._heap
        pop, push = heapq.heappop, heapq.heappush
        ran = 0
        limit = max_events if max_events is not None else -1
        wall0 = time.perf_counter()  # wall time is reported (sim/wall ratio), never used in a decision
        seq = self._seq
        while heap and heap[0][0] <= until_ms and ran != limit:
            t, _, handler, payload = pop(heap)
            self.now_ms = t
            ran += 1
            self._seq = seq
            out = handler(self, payload)
            seq = self._seq  # a handler may have called schedule() (setup helpers); keep the counter in step
            if out:
                for nt, nh, np_ in out:
                    assert nt >= t, f"{getattr(nh, '__name__', nh)} scheduled at {nt} < now {t}"
                    seq += 1
                    push(heap, (nt, seq, nh, np_))
        self._seq = seq
        if until_ms != float("inf") and (not heap or heap[0][0] > until_ms) and ran != limit:
            self.now_ms = max(self.now_ms, until_ms)
        self.events_run += ran
        self.wall_s += time.perf_counter() - wall0
        return ran

    def speed(self) -> dict[str, float]:
        """Events per wall second and simulated-time / wall-time, for the progress line."""
        wall = max(self.wall_s, 1e-9)
        return {
            "events": float(self.events_run),
            "events_per_s": self.events_run / wall,
            "sim_over_wall": self.now_ms / 1000.0 / wall,
        }
