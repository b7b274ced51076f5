"""Flow-level network: links with capacities, flows with paths, strict priority across classes, max-min
fair sharing within a class.

A flow's class is its `key` (a tuple; smaller = served first). Rates come from priority water-filling:
classes in key order; inside one class, progressive filling (the classic max-min algorithm: raise every
unfrozen flow's rate together, freeze the flows of the first saturated link, repeat), each class on the
capacity the classes above it left. A flow may carry a rate cap (pacing, e.g. Karuna's minimal rate).

Incremental: a change (arrival, completion, new key or cap) marks its links dirty; only the connected
component of flows that share links with them, transitively, is recomputed, because rates outside it
cannot change. Bytes are accounted lazily per flow (remaining at t_at, constant rate since).

Units: capacities in bits/s at the interface, bytes per ms inside; sizes in bytes; times in ms.
Flows finish by events on the simulator (see `commit`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nitsum.sim.engine import Event, Simulator

_EPS_BYTES = 1e-6


def bps_to_bytes_per_ms(bps: float) -> float:
    return bps / 8.0 / 1000.0


class _NetFlow:
    __slots__ = ("fid", "path", "remaining", "t_at", "rate", "key", "cap", "version", "size", "start_ms", "meta")

    def __init__(
        self, fid: Any, path: tuple[str, ...], size: float, key: tuple, cap: float | None, now_ms: float, meta: Any
    ) -> None:
        self.fid = fid
        self.path = path
        self.size = size
        self.remaining = size
        self.t_at = now_ms
        self.rate = 0.0  # bytes per ms
        self.key = key
        self.cap = cap  # bytes per ms, or None
        self.version = 0
        self.start_ms = now_ms
        self.meta = meta


class Network:
    """Links and active flows; call `commit(now_ms)` after changes and return its events from the handler."""

    def __init__(self, on_done: Callable[[Simulator, Any, float], Iterable[Event] | None] | None = None) -> None:
        self.capacity: dict[str, float] = {}  # link -> bytes/ms
        self.flows: dict[Any, _NetFlow] = {}
        self._on_link: dict[str, set[Any]] = {}
        self._dirty: set[str] = set()
        self._heap: list[tuple[float, int, Any]] = []  # (finish ms, version, flow id)
        self._wake_version = 0
        self._scheduled_wake = math.inf
        self.on_done = on_done
        self.reallocations = 0
        self.flows_done = 0

    # -- topology ------------------------------------------------------------------------------------------
    def add_link(self, link_id: str, capacity_bps: float) -> None:
        assert capacity_bps > 0, f"link {link_id}: capacity must be > 0"
        self.capacity[link_id] = bps_to_bytes_per_ms(capacity_bps)
        self._on_link.setdefault(link_id, set())

    # -- flows ---------------------------------------------------------------------------------------------
    def add_flow(
        self,
        fid: Any,
        path: Sequence[str],
        size_bytes: float,
        now_ms: float,
        key: tuple = (0,),
        cap_bps: float | None = None,
        meta: Any = None,
    ) -> None:
        assert fid not in self.flows, f"flow {fid!r} added twice"
        assert path, f"flow {fid!r} has an empty path"
        for link in path:
            assert link in self.capacity, f"flow {fid!r}: unknown link {link!r}"
        f = _NetFlow(
            fid,
            tuple(path),
            float(size_bytes),
            key,
            None if cap_bps is None else bps_to_bytes_per_ms(cap_bps),
            now_ms,
            meta,
        )
        self.flows[fid] = f
        for link in f.path:
            self._on_link[link].add(fid)
            self._dirty.add(link)

    def set_key(self, fid: Any, key: tuple, now_ms: float) -> None:
        f = self.flows.get(fid)
        if f is None or f.key == key:
            return
        f.key = key
        self._dirty.update(f.path)

    def set_cap(self, fid: Any, cap_bps: float | None, now_ms: float) -> None:
        f = self.flows.get(fid)
        if f is None:
            return
        cap = None if cap_bps is None or math.isinf(cap_bps) else bps_to_bytes_per_ms(cap_bps)
        if cap != f.cap:
            f.cap = cap
            self._dirty.update(f.path)

    def remove_flow(self, fid: Any, now_ms: float) -> None:
        f = self.flows.pop(fid, None)
        if f is None:
            return
        for link in f.path:
            self._on_link[link].discard(fid)
            self._dirty.add(link)

    def remaining_bytes(self, fid: Any, now_ms: float) -> float:
        f = self.flows[fid]
        return max(f.remaining - f.rate * (now_ms - f.t_at), 0.0)

    def rate_bps(self, fid: Any) -> float:
        return self.flows[fid].rate * 8000.0

    # -- allocation ----------------------------------------------------------------------------------------
    def _component(self) -> tuple[list[_NetFlow], set[str]]:
        links = set()
        seen: set[Any] = set()
        stack = list(self._dirty)
        self._dirty = set()
        flows: list[_NetFlow] = []
        on_link, all_flows = self._on_link, self.flows
        while stack:
            link = stack.pop()
            if link in links:
                continue
            links.add(link)
            for fid in on_link[link]:
                if fid not in seen:
                    seen.add(fid)
                    f = all_flows[fid]
                    flows.append(f)
                    for other in f.path:
                        if other not in links:
                            stack.append(other)
        return flows, links

    def _reallocate(self, now_ms: float) -> None:
        if not self._dirty:
            return
        self.reallocations += 1
        flows, links = self._component()
        residual = {link: self.capacity[link] for link in links}
        flows.sort(key=lambda f: f.key)
        i, n = 0, len(flows)
        new_rate: dict[Any, float] = {}
        while i < n:
            j = i + 1
            key = flows[i].key
            while j < n and flows[j].key == key:
                j += 1
            if j == i + 1:  # a class of one: it takes what its path has left (the common case under RMLQ)
                f = flows[i]
                r = min(residual[link] for link in f.path)
                if f.cap is not None and f.cap < r:
                    r = f.cap
                r = max(r, 0.0)
                for link in f.path:
                    residual[link] -= r
                new_rate[f.fid] = r
            else:
                self._fill_class(flows[i:j], residual, new_rate)
            i = j
        heap = self._heap
        for f in flows:
            r = new_rate[f.fid]
            # settle bytes sent at the old rate before switching rates
            f.remaining = max(f.remaining - f.rate * (now_ms - f.t_at), 0.0)
            f.t_at = now_ms
            if r != f.rate or f.version == 0:
                f.rate = r
                f.version += 1
                if f.remaining <= _EPS_BYTES:
                    heapq.heappush(heap, (now_ms, f.version, f.fid))
                elif r > 0:
                    heapq.heappush(heap, (now_ms + f.remaining / r, f.version, f.fid))

    @staticmethod
    def _fill_class(cls: list[_NetFlow], residual: dict[str, float], out: dict[Any, float]) -> None:
        """Progressive filling of one class on the residual capacities (max-min fair, with caps)."""
        active = {f.fid: f for f in cls}
        count: dict[str, int] = {}
        for f in cls:
            for link in f.path:
                count[link] = count.get(link, 0) + 1
        while active:
            share, bottleneck = math.inf, None
            for link, c in count.items():
                if c > 0:
                    s = residual[link] / c
                    if s < share:
                        share, bottleneck = s, link
            cap_f = min((f for f in active.values() if f.cap is not None), key=lambda f: f.cap, default=None)
            if cap_f is not None and cap_f.cap <= share:
                frozen = [cap_f]
                rate = cap_f.cap
            else:
                frozen = [f for f in active.values() if bottleneck in f.path]
                rate = share
            rate = max(rate, 0.0)
            for f in frozen:
                out[f.fid] = rate
                del active[f.fid]
                for link in f.path:
                    residual[link] -= rate
                    count[link] -= 1

    # -- events --------------------------------------------------------------------------------------------
    def commit(self, now_ms: float) -> list[Event]:
        """Recompute rates where something changed; returns the wake-up event for the next completion."""
        self._reallocate(now_ms)
        heap = self._heap
        while heap:
            t, version, fid = heap[0]
            f = self.flows.get(fid)
            if f is None or f.version != version:
                heapq.heappop(heap)
                continue
            break
        if not heap:
            return []
        t = max(heap[0][0], now_ms)
        if t >= self._scheduled_wake and self._scheduled_wake >= now_ms:
            return []  # an earlier (or equal) wake is already on the simulator's heap
        self._wake_version += 1
        self._scheduled_wake = t
        return [(t, self._wake, self._wake_version)]

    def _wake(self, sim: Simulator, version: int) -> list[Event]:
        if version != self._wake_version:
            return []
        now = sim.now_ms
        self._scheduled_wake = math.inf
        events: list[Event] = []
        heap = self._heap
        done: list[_NetFlow] = []
        while heap and heap[0][0] <= now + 1e-9:
            _, v, fid = heapq.heappop(heap)
            f = self.flows.get(fid)
            if f is None or f.version != v:
                continue
            done.append(f)
        for f in done:
            self.remove_flow(f.fid, now)
            self.flows_done += 1
        for f in done:
            if self.on_done is not None:
                more = self.on_done(sim, f, now)
                if more:
                    events.extend(more)
        events.extend(self.commit(now))
        return events


__all__ = ["Network", "bps_to_bytes_per_ms"]
