"""Synthetic arrival processes: Poisson and gamma (burstiness set by the CV of inter-arrival gaps).

Lengths are either fixed (`prompt_tokens`, `output_tokens`) or drawn with replacement from `lengths`, a list of
requests (e.g. a trace), so a synthetic arrival process can carry a real length distribution.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from nitsum.workloads.request import TraceRequest


def _gaps_to_requests(
    gap_ms: Callable[[], float],
    rng: random.Random,
    *,
    duration_s: float | None,
    num_requests: int | None,
    lengths: Sequence[TraceRequest] | None,
    prompt_tokens: int,
    output_tokens: int,
    tier: str,
    source: str,
) -> list[TraceRequest]:
    if (duration_s is None) == (num_requests is None):
        raise ValueError("give exactly one of duration_s and num_requests")
    end_ms = None if duration_s is None else duration_s * 1000.0
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        if num_requests is not None and len(out) >= num_requests:
            break
        if end_ms is not None and t >= end_ms:
            break
        if lengths:
            ref = lengths[rng.randrange(len(lengths))]
            p, o, h = ref.prompt_tokens, ref.output_tokens, ref.prefix_hash_ids
        else:
            p, o, h = prompt_tokens, output_tokens, ()
        out.append(
            TraceRequest(arrival_ms=t, prompt_tokens=p, output_tokens=o, tier=tier, prefix_hash_ids=h, source=source)
        )
        t += gap_ms()
    return out


def poisson(
    rate_per_s: float,
    *,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    lengths: Sequence[TraceRequest] | None = None,
    prompt_tokens: int = 512,
    output_tokens: int = 128,
    tier: str = "interactive",
) -> list[TraceRequest]:
    """Poisson arrivals at `rate_per_s`, for `duration_s` seconds or `num_requests` requests; first at 0 ms."""
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    rng = random.Random(seed)
    mean_gap_ms = 1000.0 / rate_per_s
    return _gaps_to_requests(
        lambda: rng.expovariate(1.0 / mean_gap_ms),
        rng,
        duration_s=duration_s,
        num_requests=num_requests,
        lengths=lengths,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        tier=tier,
        source="poisson",
    )


def gamma(
    rate_per_s: float,
    cv: float,
    *,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    lengths: Sequence[TraceRequest] | None = None,
    prompt_tokens: int = 512,
    output_tokens: int = 128,
    tier: str = "interactive",
) -> list[TraceRequest]:
    """Gamma-renewal arrivals: mean gap 1/rate, coefficient of variation `cv` (cv=1 is Poisson, >1 bursty).

    Shape k = 1/cv², scale θ = mean·cv², so mean = kθ and CV = 1/√k.
    """
    if not rate_per_s > 0 or not cv > 0:
        raise ValueError(f"rate_per_s and cv must be > 0, got {rate_per_s}, {cv}")
    rng = random.Random(seed)
    mean_gap_ms = 1000.0 / rate_per_s
    shape = 1.0 / (cv * cv)
    scale = mean_gap_ms * cv * cv
    return _gaps_to_requests(
        lambda: rng.gammavariate(shape, scale),
        rng,
        duration_s=duration_s,
        num_requests=num_requests,
        lengths=lengths,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        tier=tier,
        source="gamma",
    )
