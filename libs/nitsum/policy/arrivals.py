"""What keeps coming, not only what is queued: a tier's recent arrivals (`ArrivalStats`, the snapshot's optional
`arrivals`) and the sliding window that measures them (`ArrivalWindow`), one for the live coordinator and the
simulator alike. Nothing here reads a clock: callers pass `now_ms`."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ArrivalStats:
    """Recent arrivals of one tier, measured by the caller over a sliding window (optional input).

    The live set of requests says what is queued now, not what keeps coming: a layout that drains today's
    backlog can still fall behind the arrival stream. With these the adaptive policy also scores whether
    a candidate sustains the stream (estimate.evaluate, "stream"); without them it scores the backlog only.
    """

    tier: str
    rate_per_s: float  # arrivals per second offered to the cluster (admitted or not)
    ttft_ms: float
    tpot_ms: float
    weight: float
    prompt_tokens: tuple[int, ...]  # means of equal-mass slices of uncached prompt lengths, ascending (see measure)
    output_tokens: float  # mean max_tokens

    @staticmethod
    def measure(
        tier: str,
        window_ms: float,
        ttft_ms: float,
        tpot_ms: float,
        weight: float,
        lengths: list[tuple[int, int]],
        quantiles: int = 4,
    ) -> ArrivalStats:
        """From the (prompt tokens, max tokens) of the tier's arrivals in the last `window_ms`: the rate,
        the mean prompt length of each of `quantiles` equal-mass slices (sorted), the mean output."""
        assert window_ms > 0 and quantiles >= 1
        n = len(lengths)
        prompts = sorted(p for p, _ in lengths)
        # Each slice's mean, not its midpoint: the slices then average to the true mean prompt (a right-skewed
        # length distribution's midpoints sat ~1/3 above it for Azure code, and the policy's load estimate with them).
        mids = []
        for j in range(quantiles if n else 0):
            lo, hi = int(j * n / quantiles), max(int((j + 1) * n / quantiles), int(j * n / quantiles) + 1)
            part = prompts[lo : min(hi, n)] or prompts[-1:]
            mids.append(int(round(sum(part) / len(part))))
        mids = tuple(mids)
        out = sum(o for _, o in lengths) / n if n else 0.0
        return ArrivalStats(tier, n / window_ms * 1e3, ttft_ms, tpot_ms, weight, mids, out)


class ArrivalWindow:
    """Arrivals of the last `window_ms` per tier: what keeps coming, not only what is queued. One class for the
    live coordinator and the simulator, so both give the policy the same `ClusterSnapshot.arrivals`.

    `started_ms`: when measuring began (the simulator: 0; the coordinator: its boot). Rates are then counted over
    min(window, now − started) instead of the whole window, so the first seconds are not under-counted.
    None divides by the window always.

    `detect_shifts` (the simulator): track when the stream shifts (`shift_ms`, ClusterSnapshot.load_shift_ms).
    `regime_ms` > 0 (the simulator: 60 s, with detect_shifts): once the stream has been steady (no shift, see `_detect_shift`) for
    longer than the window, rates and lengths are measured over all of the steady stretch, up to `regime_ms`,
    instead of the last window only: a 5 s window of a 7 req/s stream is ±17 % noise, which put a layout at
    ρ ≈ 1 one epoch and ρ ≈ 0.75 the next. 0 (the coordinator, for now): the window only.

    `refresh_ms` > 0 (the coordinator): `stats` answers with what it measured up to `refresh_ms` ago instead of
    measuring again. Measuring walks every arrival of the window, and the coordinator asks on every submission:
    at 400 req/s that was ~2,000 arrivals walked per request, a third of the coordinator's CPU. A 5 s window's
    figures move by ~1 % in 50 ms. 0 (the simulator): measured at every call."""

    # A shift: some tier's count over the window differs from the rate since the last shift by more than
    # SHIFT_Z Poisson standard deviations AND by more than SHIFT_FRACTION of it.
    SHIFT_Z = 3.0
    SHIFT_FRACTION = 0.3
    STOP_GAPS = 5.0

    def __init__(
        self,
        window_ms: float = 5000.0,
        started_ms: float | None = None,
        regime_ms: float = 0.0,
        detect_shifts: bool = False,
        refresh_ms: float = 0.0,
    ) -> None:
        assert window_ms > 0 and regime_ms >= 0, "window_ms must be > 0, regime_ms >= 0"
        assert refresh_ms >= 0 and not (refresh_ms and detect_shifts), "refresh_ms >= 0, and not with detect_shifts"
        self.refresh_ms = refresh_ms
        self._measured: tuple[float, tuple[ArrivalStats, ...]] | None = None  # (when, what) of the last `stats`
        self.window_ms = window_ms
        self.started_ms = started_ms
        self.regime_ms = regime_ms
        self._events: deque[tuple[float, str, float, float, float, int, int]] = deque()
        self._long: deque[tuple[float, str, float, float, float, int, int]] = deque()  # the last regime_ms
        # When the stream last shifted (see `_detect_shift`); the start of measuring counts as one. None: shifts
        # are not tracked (detect_shifts False: the coordinator for now), and the policy's rules that use them
        # stay off.
        self.detect_shifts = detect_shifts
        self.shift_ms: float | None = started_ms if detect_shifts else None
        # Whether the stream has stopped since the last shift, as of the last `stats`: nothing has arrived for
        # STOP_GAPS mean gaps of the regime that shift ended (for a stream still at that rate P = e^-5 < 1 %;
        # one that fell far may look stopped until its next arrival). None: shifts are not tracked.
        self.shift_stopped: bool | None = False if detect_shifts else None
        self._ended_rate = 0.0  # arrivals per ms, all tiers, of the regime the last shift ended
        self._since_ms = started_ms  # start of the current regime (None: first stats call)
        self._since_counts: dict[str, int] = {}  # arrivals per tier since the regime began

    def add(
        self,
        now_ms: float,
        tier: str,
        ttft_ms: float,
        tpot_ms: float,
        weight: float,
        prompt_tokens: int,
        max_tokens: int,
    ) -> None:
        self._events.append((now_ms, tier, ttft_ms, tpot_ms, weight, prompt_tokens, max_tokens))
        if self.regime_ms > 0 and self.detect_shifts:
            self._long.append(self._events[-1])
        self._since_counts[tier] = self._since_counts.get(tier, 0) + 1

    def _detect_shift(self, now_ms: float, span: float, counts: dict[str, int]) -> None:
        """Compare the window's counts with the regime's mean rate; a significant move starts a new regime
        (at the start of the window, where the new stream began at the latest)."""
        if self._since_ms is None:
            self._since_ms = now_ms - span
            if self.detect_shifts and self.shift_ms is None:
                self.shift_ms = self._since_ms
        if not self.detect_shifts:
            return
        age = now_ms - self._since_ms
        if age < 3 * self.window_ms or span <= 0:
            return  # the regime's own rate is not yet known better than the window's
        for tier in set(counts) | set(self._since_counts):
            expected = self._since_counts.get(tier, 0) / age * span
            got = counts.get(tier, 0)
            if abs(got - expected) > max(self.SHIFT_Z * math.sqrt(expected + 1.0), self.SHIFT_FRACTION * expected):
                # The new regime's rate is measured from here on (the window still mixes in the old one).
                self._ended_rate = sum(self._since_counts.values()) / age
                self.shift_ms = now_ms - span
                self._since_ms = now_ms
                self._since_counts = {}
                return

    def stats(self, now_ms: float) -> tuple[ArrivalStats, ...]:
        measured = self._measured
        if measured is not None and 0 <= now_ms - measured[0] < self.refresh_ms:
            return measured[1]
        stats = self._measure(now_ms)
        if self.refresh_ms > 0:
            self._measured = (now_ms, stats)
        return stats

    def _measure(self, now_ms: float) -> tuple[ArrivalStats, ...]:
        while self._events and now_ms - self._events[0][0] > self.window_ms:
            self._events.popleft()
        span = self.window_ms
        if self.started_ms is not None:
            span = min(span, now_ms - self.started_ms)
            if span <= 0:
                return ()
        by_tier: dict[str, list] = {}
        for event in self._events:
            by_tier.setdefault(event[1], []).append(event)
        self._detect_shift(now_ms, span, {t: len(e) for t, e in by_tier.items()})
        if self.detect_shifts:
            last = self._events[-1][0] if self._events else -math.inf
            self.shift_stopped = (now_ms - last) * self._ended_rate >= self.STOP_GAPS
        if self.regime_ms > 0 and self.detect_shifts:
            while self._long and now_ms - self._long[0][0] > self.regime_ms:
                self._long.popleft()
            since = self._since_ms if self._since_ms is not None else now_ms
            steady = min(now_ms - since, self.regime_ms)
            if steady > self.window_ms:
                by_tier = {}
                for event in self._long:
                    if event[0] >= now_ms - steady:
                        by_tier.setdefault(event[1], []).append(event)
                span = steady
        return tuple(
            ArrivalStats.measure(
                tier, span, events[-1][2], events[-1][3], events[-1][4], [(e[5], e[6]) for e in events]
            )
            for tier, events in sorted(by_tier.items())
        )
