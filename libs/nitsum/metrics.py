"""The one metric schema: request lifecycle records -> per-tier TTFT / TPOT / SLO attainment / goodput.

The load generator, the simulator and the live coordinator all report through this module, so a number
called "goodput" means the same thing everywhere (ALGORITHMS.md §0, CONVENTIONS.md rule 11).

Definitions (times in milliseconds on one clock, any origin):
- TTFT = first_token_ms - send_ms (send = arrival at the system under test).
- TPOT = (finish_ms - first_token_ms) / (output_tokens - 1). Undefined for outputs of fewer than two
  tokens; such a request counts as meeting its TPOT target.
- A request *meets its SLO* when it finished without error, TTFT <= its TTFT target and TPOT <= its TPOT
  target (the comparison is inclusive).
- SLO attainment = requests meeting their SLO / all requests (failed and unfinished ones are misses).
- Goodput = requests meeting their SLO per second of the measurement window; weighted goodput sums the
  requests' tier weights instead of counting them.
- The window is `duration_s` when given, else from the earliest send to the latest event of any record.
- Percentiles use linear interpolation between closest ranks (numpy's default "linear" method, Hyndman &
  Fan type 7): for sorted x[0..n-1] and q in [0, 100], rank h = (n - 1) * q / 100 and the value is
  x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]).
- TTFT percentiles are over every request that received a first token (even one that failed later);
  TPOT percentiles over requests that finished without error with >= 2 output tokens; inter-token latency
  (ITL) over the gaps between consecutive token times of every record that has them.

Pure standard library (no numpy), deterministic, no clock reads: the simulator's stdlib-only core uses it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nitsum.policy.tiers import DEFAULT_TIERS, Tier, resolve_slo

# Error kinds the load generator emits; any other string is allowed and reported as is.
ERROR_KINDS: tuple[str, ...] = (
    "http_429",
    "http_503",
    "http_4xx",
    "http_5xx",
    "timeout",
    "connection",
    "stream_error",
    "cancelled",
)
# Kind reported for a record that neither finished nor carries an error (e.g. still in flight at a cut-off).
UNFINISHED = "unfinished"
OVERALL = "all"
PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """One request's lifecycle as observed by whoever measures it (client, simulator or coordinator)."""

    request_id: str
    tier: str
    ttft_slo_ms: float
    tpot_slo_ms: float
    weight: float
    send_ms: float
    first_token_ms: float | None
    finish_ms: float | None
    output_tokens: int
    prompt_tokens: int
    # Arrival time of every output token (the first equals first_token_ms); empty when not recorded.
    token_times_ms: tuple[float, ...] = ()
    # Error kind (see ERROR_KINDS) or None for a request that did not fail.
    error: str | None = None

    def __post_init__(self) -> None:
        assert self.output_tokens >= 0 and self.prompt_tokens >= 0, "token counts must be >= 0"
        assert self.ttft_slo_ms > 0 and self.tpot_slo_ms > 0, "SLO targets must be > 0"
        if self.first_token_ms is not None:
            assert self.first_token_ms >= self.send_ms, "first token cannot precede the send"
        if self.finish_ms is not None:
            assert self.finish_ms >= self.send_ms, "finish cannot precede the send"
            if self.first_token_ms is not None:
                assert self.finish_ms >= self.first_token_ms, "finish cannot precede the first token"

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_ms is None else self.first_token_ms - self.send_ms

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first; None when undefined (no finish, < 2 tokens)."""
        if self.first_token_ms is None or self.finish_ms is None or self.output_tokens < 2:
            return None
        return (self.finish_ms - self.first_token_ms) / (self.output_tokens - 1)

    @property
    def succeeded(self) -> bool:
        return self.error is None and self.finish_ms is not None

    @property
    def outcome(self) -> str:
        """'ok', the error kind, or UNFINISHED."""
        if self.error is not None:
            return self.error
        return "ok" if self.finish_ms is not None else UNFINISHED

    @property
    def ttft_met(self) -> bool:
        ttft = self.ttft_ms
        return ttft is not None and ttft <= self.ttft_slo_ms

    @property
    def tpot_met(self) -> bool:
        """Finished with TPOT within target; a finished request with < 2 tokens counts as met."""
        if not self.succeeded:
            return False
        tpot = self.tpot_ms
        return tpot is None or tpot <= self.tpot_slo_ms

    @property
    def slo_met(self) -> bool:
        return self.succeeded and self.ttft_met and self.tpot_met

    @property
    def last_event_ms(self) -> float:
        times = [self.send_ms]
        times += [t for t in (self.first_token_ms, self.finish_ms) if t is not None]
        if self.token_times_ms:
            times.append(self.token_times_ms[-1])
        return max(times)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tier": self.tier,
            "ttft_slo_ms": self.ttft_slo_ms,
            "tpot_slo_ms": self.tpot_slo_ms,
            "weight": self.weight,
            "send_ms": self.send_ms,
            "first_token_ms": self.first_token_ms,
            "finish_ms": self.finish_ms,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "token_times_ms": list(self.token_times_ms),
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestRecord:
        """Inverse of to_dict (e.g. one line of a JSON-lines lifecycle log)."""
        return cls(
            request_id=str(data["request_id"]),
            tier=str(data["tier"]),
            ttft_slo_ms=float(data["ttft_slo_ms"]),
            tpot_slo_ms=float(data["tpot_slo_ms"]),
            weight=float(data["weight"]),
            send_ms=float(data["send_ms"]),
            first_token_ms=_opt_float(data.get("first_token_ms")),
            finish_ms=_opt_float(data.get("finish_ms")),
            output_tokens=int(data["output_tokens"]),
            prompt_tokens=int(data["prompt_tokens"]),
            token_times_ms=tuple(float(t) for t in data.get("token_times_ms") or ()),
            error=None if data.get("error") is None else str(data["error"]),
        )


def make_record(
    *,
    request_id: str,
    tier: str | None,
    send_ms: float,
    first_token_ms: float | None,
    finish_ms: float | None,
    output_tokens: int,
    prompt_tokens: int,
    token_times_ms: Iterable[float] = (),
    error: str | None = None,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
    tiers: dict[str, Tier] = DEFAULT_TIERS,
) -> RequestRecord:
    """A record whose targets and weight come from the tier table (resolve_slo), with per-request overrides."""
    slo = resolve_slo(tier, ttft_slo_ms, tpot_slo_ms, tiers=tiers)
    return RequestRecord(
        request_id=request_id,
        tier=slo.tier,
        ttft_slo_ms=slo.ttft_ms,
        tpot_slo_ms=slo.tpot_ms,
        weight=slo.weight,
        send_ms=send_ms,
        first_token_ms=first_token_ms,
        finish_ms=finish_ms,
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        token_times_ms=tuple(token_times_ms),
        error=error,
    )


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    xs = sorted(values)
    if not xs:
        return None
    rank = (len(xs) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency sample in ms; every statistic is None when count == 0."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        xs = sorted(values)
        if not xs:
            return cls(0, None, None, None, None, None)
        return cls(
            count=len(xs),
            mean=math.fsum(xs) / len(xs),
            p50=percentile(xs, 50.0),
            p90=percentile(xs, 90.0),
            p99=percentile(xs, 99.0),
            max=xs[-1],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "max": self.max,
        }


@dataclass(frozen=True)
class TierSummary:
    """Everything reported for one tier (or for all requests together, tier == OVERALL)."""

    tier: str
    requests: int
    succeeded: int
    failed: int  # requests with an error kind
    unfinished: int  # neither finished nor failed
    slo_met: int
    ttft_met: int
    tpot_met: int
    slo_attainment: float | None  # None when there are no requests
    ttft_attainment: float | None
    tpot_attainment: float | None
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    goodput_rps: float | None  # None when the window is zero
    weighted_goodput_rps: float | None
    throughput_rps: float | None  # requests that succeeded per second, SLO or not
    output_tokens_per_s: float | None  # output tokens of succeeded requests per second
    errors: dict[str, int] = field(default_factory=dict)  # kind -> count, includes UNFINISHED

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "requests": self.requests,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "unfinished": self.unfinished,
            "slo_met": self.slo_met,
            "ttft_met": self.ttft_met,
            "tpot_met": self.tpot_met,
            "slo_attainment": self.slo_attainment,
            "ttft_attainment": self.ttft_attainment,
            "tpot_attainment": self.tpot_attainment,
            "ttft_ms": self.ttft_ms.to_dict(),
            "tpot_ms": self.tpot_ms.to_dict(),
            "itl_ms": self.itl_ms.to_dict(),
            "goodput_rps": self.goodput_rps,
            "weighted_goodput_rps": self.weighted_goodput_rps,
            "throughput_rps": self.throughput_rps,
            "output_tokens_per_s": self.output_tokens_per_s,
            "errors": dict(sorted(self.errors.items())),
        }


@dataclass(frozen=True)
class Report:
    duration_s: float
    tiers: dict[str, TierSummary]  # known tiers in tier-table order, then others by name
    overall: TierSummary

    def to_dict(self) -> dict[str, Any]:
        return {
            "duration_s": self.duration_s,
            "tiers": {name: s.to_dict() for name, s in self.tiers.items()},
            "overall": self.overall.to_dict(),
        }


def window_s(records: Iterable[RequestRecord]) -> float:
    """Seconds from the earliest send to the latest event; 0.0 for no records."""
    recs = list(records)
    if not recs:
        return 0.0
    start = min(r.send_ms for r in recs)
    end = max(r.last_event_ms for r in recs)
    return (end - start) / 1000.0


def sent_between(records: Iterable[RequestRecord], start_ms: float, end_ms: float) -> list[RequestRecord]:
    """Records sent in [start_ms, end_ms), e.g. to leave a warm-up and a cool-down out of a report (pass the
    window's length as summarize's duration_s so rates stay per second of that window)."""
    return [r for r in records if start_ms <= r.send_ms < end_ms]


def summarize_tier(tier: str, records: Iterable[RequestRecord], duration_s: float) -> TierSummary:
    """Summary of the given records (assumed to belong together) over a window of duration_s seconds."""
    recs = list(records)
    n = len(recs)
    ok = [r for r in recs if r.succeeded]
    met = [r for r in recs if r.slo_met]
    errors: dict[str, int] = {}
    for r in recs:
        if r.outcome != "ok":
            errors[r.outcome] = errors.get(r.outcome, 0) + 1
    itl: list[float] = []
    for r in recs:
        times = r.token_times_ms
        itl.extend(b - a for a, b in zip(times, times[1:]))
    n_ttft_met = sum(1 for r in recs if r.ttft_met)
    n_tpot_met = sum(1 for r in recs if r.tpot_met)

    def frac(k: int) -> float | None:
        return k / n if n else None

    def rate(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    return TierSummary(
        tier=tier,
        requests=n,
        succeeded=len(ok),
        failed=sum(1 for r in recs if r.error is not None),
        unfinished=errors.get(UNFINISHED, 0),
        slo_met=len(met),
        ttft_met=n_ttft_met,
        tpot_met=n_tpot_met,
        slo_attainment=frac(len(met)),
        ttft_attainment=frac(n_ttft_met),
        tpot_attainment=frac(n_tpot_met),
        ttft_ms=Distribution.of(t for r in recs if (t := r.ttft_ms) is not None),
        tpot_ms=Distribution.of(t for r in ok if (t := r.tpot_ms) is not None),
        itl_ms=Distribution.of(itl),
        goodput_rps=rate(len(met)),
        weighted_goodput_rps=rate(math.fsum(r.weight for r in met)),
        throughput_rps=rate(len(ok)),
        output_tokens_per_s=rate(sum(r.output_tokens for r in ok)),
        errors=errors,
    )


def summarize(
    records: Iterable[RequestRecord],
    duration_s: float | None = None,
    tier_order: Iterable[str] = tuple(DEFAULT_TIERS),
) -> Report:
    """Per-tier and overall report. Only tiers that have records appear in Report.tiers."""
    recs = list(records)
    window = window_s(recs) if duration_s is None else float(duration_s)
    if window < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s!r}")
    by_tier: dict[str, list[RequestRecord]] = {}
    for r in recs:
        by_tier.setdefault(r.tier, []).append(r)
    order = [t for t in tier_order if t in by_tier]
    order += sorted(t for t in by_tier if t not in order)
    return Report(
        duration_s=window,
        tiers={t: summarize_tier(t, by_tier[t], window) for t in order},
        overall=summarize_tier(OVERALL, recs, window),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
