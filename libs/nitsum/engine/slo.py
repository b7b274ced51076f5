"""Per-request SLOs inside the engine, and the step-cost model that sizes a step to the tightest TPOT
(no torch, no clock: the engine passes `now_ms` and the measured step times in).

Times are in milliseconds on the engine's own monotonic clock. A request's TTFT deadline is its arrival
plus its TTFT target; the scheduler serves prefills earliest deadline first and keeps every step short
enough for the TPOT of the interactive requests it is decoding.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

TIERS = ("interactive", "background")
MAX_TOKENS_LIMIT = 1 << 30  # beyond any step budget: the scheduler's own token budget bounds a step anyway


@dataclass(frozen=True)
class RequestSlo:
    tier: str
    ttft_ms: float
    tpot_ms: float
    arrival_ms: float  # engine clock (monotonic ms) at which the request reached the gateway

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not math.isfinite(self.arrival_ms):
            raise ValueError(f"arrival_ms must be finite, got {self.arrival_ms!r}")

    @property
    def interactive(self) -> bool:
        return self.tier == "interactive"

    @property
    def deadline_ms(self) -> float:
        """When the first token is due (TTFT deadline)."""
        return self.arrival_ms + self.ttft_ms

    @classmethod
    def from_unix(
        cls, tier: str, ttft_ms: float, tpot_ms: float, arrival_unix_ms: float, now_unix_ms: float, now_ms: float
    ) -> RequestSlo:
        """A request stamped with the gateway's wall clock, placed on the engine's monotonic clock. A stamp
        from the future (clock skew between hosts) counts as arriving now."""
        age_ms = max(0.0, now_unix_ms - arrival_unix_ms)
        return cls(tier=tier, ttft_ms=ttft_ms, tpot_ms=tpot_ms, arrival_ms=now_ms - age_ms)


class StepCostModel:
    """step_ms ~= base_ms + per_token_ms * tokens, least squares over the last `window` measured steps.

    Until two different token counts have been seen there is no fit and no limit (`max_tokens_within`
    returns None): the scheduler then uses its plain token budget."""

    def __init__(self, window: int = 64) -> None:
        assert window >= 2, "a fit needs at least two points"
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._fixed = False

    def observe(self, num_tokens: int, ms: float) -> None:
        """One measured step (ignored after `set_fit`)."""
        if self._fixed or num_tokens <= 0 or not math.isfinite(ms) or ms < 0:
            return
        self._samples.append((num_tokens, ms))
        self._fit = None

    def fit(self) -> tuple[float, float] | None:
        """(base_ms, per_token_ms), or None without two distinct token counts."""
        if self._fit is None and len({n for n, _ in self._samples}) >= 2:
            xs = [float(n) for n, _ in self._samples]
            ys = [ms for _, ms in self._samples]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            slope = max(1e-6, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
            self._fit = (max(0.0, my - slope * mx), slope)
        return self._fit

    def set_fit(self, base_ms: float, per_token_ms: float) -> None:
        """A known cost (tests, or a profiled table) instead of measured steps."""
        assert per_token_ms > 0 and base_ms >= 0, "a step costs time"
        self._samples.clear()
        self._fit = (base_ms, per_token_ms)
        self._fixed = True

    def max_tokens_within(self, ms: float) -> int | None:
        fit = self.fit()
        if fit is None:
            return None
        base_ms, per_token_ms = fit
        tokens = (ms - base_ms) / per_token_ms
        if not math.isfinite(tokens):
            return None  # a target so loose (e.g. 1e308 ms) that it sets no limit
        return max(0, int(min(tokens, MAX_TOKENS_LIMIT)))
