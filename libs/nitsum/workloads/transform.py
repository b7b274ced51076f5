"""Transformations of request lists: tier labels, time scaling, windows, and a summary."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence

from nitsum.workloads.request import TraceRequest


def assign_tiers(reqs: Sequence[TraceRequest], fractions: Mapping[str, float], seed: int = 0) -> list[TraceRequest]:
    """Label requests with tiers in exact proportions: n_tier = round-by-largest-remainder(fraction · n).

    Exact counts (not an independent coin per request) keep small runs at the asked mix, so results and tests
    do not wobble with the seed. Which request gets which label is a seeded shuffle. Fractions must sum to 1.
    """
    if not fractions:
        raise ValueError("fractions must name at least one tier")
    total = sum(fractions.values())
    if any(f < 0 for f in fractions.values()) or abs(total - 1.0) > 1e-9:
        raise ValueError(f"fractions must be >= 0 and sum to 1, got {dict(fractions)}")
    n = len(reqs)
    names = list(fractions)  # caller's order, so the result does not depend on dict hashing
    exact = [fractions[name] * n for name in names]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(names)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    labels = [name for name, c in zip(names, counts) for _ in range(c)]
    random.Random(seed).shuffle(labels)
    return [dataclasses.replace(r, tier=label) for r, label in zip(reqs, labels)]


def scale_time(reqs: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply every arrival time by `factor`: 0.5 replays twice as fast (double the rate), 2 half as fast."""
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    return [dataclasses.replace(r, arrival_ms=r.arrival_ms * factor) for r in reqs]


def mean_rate_per_s(reqs: Sequence[TraceRequest]) -> float:
    """Requests per second over the span first..last arrival (n-1 gaps); 0 for fewer than two requests."""
    if len(reqs) < 2:
        return 0.0
    span_ms = max(r.arrival_ms for r in reqs) - min(r.arrival_ms for r in reqs)
    return (len(reqs) - 1) * 1000.0 / span_ms if span_ms > 0 else math.inf


def scale_to_rate(reqs: Sequence[TraceRequest], rate_per_s: float) -> list[TraceRequest]:
    """Rescale time so the mean arrival rate becomes `rate_per_s`, keeping the trace's burstiness shape."""
    current = mean_rate_per_s(reqs)
    if not current > 0 or math.isinf(current):
        raise ValueError("need at least two requests with distinct arrival times to scale the rate")
    return scale_time(reqs, current / rate_per_s)


def window(reqs: Sequence[TraceRequest], start_ms: float, end_ms: float, *, rebase: bool = True) -> list[TraceRequest]:
    """Requests arriving in [start_ms, end_ms); with `rebase` the window starts at 0 ms."""
    shift = start_ms if rebase else 0.0
    return [dataclasses.replace(r, arrival_ms=r.arrival_ms - shift) for r in reqs if start_ms <= r.arrival_ms < end_ms]


def summarize_workload(reqs: Sequence[TraceRequest]) -> dict[str, float]:
    """Counts, span, rate and length means, for reports and sanity checks."""
    if not reqs:
        return {"requests": 0, "span_s": 0.0, "rate_per_s": 0.0, "prompt_mean": 0.0, "output_mean": 0.0}
    n = len(reqs)
    return {
        "requests": n,
        "span_s": (max(r.arrival_ms for r in reqs) - min(r.arrival_ms for r in reqs)) / 1000.0,
        "rate_per_s": mean_rate_per_s(reqs),
        "prompt_mean": sum(r.prompt_tokens for r in reqs) / n,
        "output_mean": sum(r.output_tokens for r in reqs) / n,
    }
