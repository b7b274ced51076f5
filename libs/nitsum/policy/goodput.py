"""Per-request SLO checks and goodput accounting (ALGORITHMS.md §0), with the exact definitions.

- TTFT = first-token time − arrival time.
- TPOT = (finish time − first-token time) / (output tokens − 1); a request with one output token has no
  TPOT to miss (0).
- A request counts toward goodput only if it finished and met *both* its TTFT and TPOT targets; weighted
  goodput multiplies by its tier weight. Rates are per second of the measured window.

The live metrics, the load generator and the simulator are meant to call these same functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutcome:
    request_id: str
    tier: str
    weight: float
    ttft_target_ms: float
    tpot_target_ms: float
    arrival_ms: float
    first_token_ms: float | None  # None: never produced a token
    finish_ms: float | None  # None: did not finish (shed, failed, still running)
    output_tokens: int


def ttft_ms(o: RequestOutcome) -> float | None:
    return None if o.first_token_ms is None else o.first_token_ms - o.arrival_ms


def tpot_ms(o: RequestOutcome) -> float | None:
    if o.first_token_ms is None or o.finish_ms is None:
        return None
    if o.output_tokens <= 1:
        return 0.0
    return (o.finish_ms - o.first_token_ms) / (o.output_tokens - 1)


def ttft_met(o: RequestOutcome) -> bool:
    t = ttft_ms(o)
    return t is not None and t <= o.ttft_target_ms


def tpot_met(o: RequestOutcome) -> bool:
    t = tpot_ms(o)
    return t is not None and t <= o.tpot_target_ms


def slo_met(o: RequestOutcome) -> bool:
    """Finished, and both TTFT and TPOT within target."""
    return o.finish_ms is not None and ttft_met(o) and tpot_met(o)


@dataclass(frozen=True)
class GoodputSummary:
    window_s: float
    finished: int
    met: int
    goodput_rps: float  # requests/s meeting both targets
    weighted_goodput_rps: float  # the same, times tier weight
    attainment: float  # met / all requests considered (0 when none)
    met_by_tier: tuple[tuple[str, int, int], ...]  # (tier, met, total), sorted by tier


def summarize_goodput(outcomes: Iterable[RequestOutcome], window_s: float) -> GoodputSummary:
    assert window_s > 0, "window_s must be > 0"
    total = finished = met = 0
    weighted = 0.0
    per_tier: dict[str, list[int]] = {}
    for o in outcomes:
        total += 1
        finished += o.finish_ms is not None
        ok = slo_met(o)
        t = per_tier.setdefault(o.tier, [0, 0])
        t[1] += 1
        if ok:
            met += 1
            weighted += o.weight
            t[0] += 1
    return GoodputSummary(
        window_s=window_s,
        finished=finished,
        met=met,
        goodput_rps=met / window_s,
        weighted_goodput_rps=weighted / window_s,
        attainment=met / total if total else 0.0,
        met_by_tier=tuple((k, v[0], v[1]) for k, v in sorted(per_tier.items())),
    )
