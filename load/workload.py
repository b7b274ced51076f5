"""From command-line choices to the list of requests to send: source, tier mix, time scaling, caps, SLOs.

Sources are `nitsum.workloads` (the same readers and arrival processes the simulator uses), so a load run
and a simulation given the same options replay the same requests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nitsum.policy.tiers import DEFAULT_TIERS, resolve_slo
from nitsum.workloads import (
    TraceRequest,
    assign_tiers,
    default_trace_path,
    gamma,
    poisson,
    read_csv_trace,
    read_mooncake,
    scale_time,
    scale_to_rate,
    servegen_arrivals,
)
from nitsum_load.client import RequestSpec

TRACE_ALIASES = {"mooncake": "mooncake-conv"}
# Mooncake timestamps come in ~3 s buckets; by default each bucket's requests are spread evenly over it
# (the real arrivals happened somewhere inside the bucket), not fired in one burst. 0 fires them at once.
DEFAULT_BUCKET_SPREAD_MS = 3000.0
# Synthetic sources need a bound to generate against when neither --max-requests nor --duration is given.
DEFAULT_SYNTH_DURATION_S = 60.0
DEFAULT_SERVEGEN_DURATION_S = 600.0


def parse_tier_mix(text: str) -> dict[str, float]:
    """`interactive=0.3,background=0.7` -> fractions normalized to sum 1 (so `interactive=3,background=7` works).

    Raises ValueError naming the problem (unknown tier, bad number, nothing positive)."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"tier mix entry {part!r} is not NAME=FRACTION")
        if name not in DEFAULT_TIERS:
            raise ValueError(f"unknown tier {name!r} in tier mix; known: {', '.join(DEFAULT_TIERS)}")
        try:
            frac = float(value)
        except ValueError as exc:
            raise ValueError(f"tier mix fraction for {name!r} is not a number: {value!r}") from exc
        if not frac >= 0 or math.isinf(frac):
            raise ValueError(f"tier mix fraction for {name!r} must be >= 0, got {value!r}")
        mix[name] = mix.get(name, 0.0) + frac
    total = sum(mix.values())
    if not total > 0:
        raise ValueError("tier mix needs at least one positive fraction")
    return {k: v / total for k, v in mix.items()}


def read_trace(
    name: str,
    *,
    limit: int | None = None,
    bucket_spread_ms: float = DEFAULT_BUCKET_SPREAD_MS,
    duration_s: float | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """A trace by short name (azure-conv, azure-code, mooncake, servegen:<model>), or a file path (.csv: Azure
    2023/2024 or BurstGPT, told apart by the header; .jsonl: Mooncake). `limit` keeps the first rows
    (per-request traces only). `bucket_spread_ms` spreads requests that share a stamp (Mooncake's ~3 s buckets;
    BurstGPT's whole seconds, there at most up to the next stamp)."""
    if name.startswith("servegen:"):
        model = name.split(":", 1)[1]
        path = default_trace_path(f"servegen-{model}")
        reqs = servegen_arrivals(path, duration_s=duration_s or DEFAULT_SERVEGEN_DURATION_S, seed=seed)
        return reqs[:limit] if limit is not None else reqs
    p = Path(name)
    if not p.is_file():
        p = default_trace_path(TRACE_ALIASES.get(name, name))
    if p.suffix == ".jsonl":
        # Read whole: a row limit could cut a timestamp bucket and so change how its requests are spread.
        reqs = read_mooncake(p, bucket_spread_ms=bucket_spread_ms)
        return reqs[:limit] if limit is not None else reqs
    if p.suffix == ".csv":
        return read_csv_trace(p, limit=limit, bucket_spread_ms=bucket_spread_ms)
    raise ValueError(f"{p}: cannot tell the trace format (expected .csv for Azure or BurstGPT, .jsonl for Mooncake)")


def synthetic(
    kind: str,
    rate_per_s: float,
    *,
    cv: float = 1.0,
    num_requests: int | None,
    duration_s: float | None,
    seed: int,
    lengths: Sequence[TraceRequest] | None,
    prompt_tokens: int,
    output_tokens: int,
) -> list[TraceRequest]:
    """Poisson or gamma arrivals bounded by num_requests (preferred) or duration_s."""
    if num_requests is None and duration_s is None:
        duration_s = DEFAULT_SYNTH_DURATION_S
    bound = {"num_requests": num_requests} if num_requests is not None else {"duration_s": duration_s}
    common = dict(seed=seed, lengths=lengths, prompt_tokens=prompt_tokens, output_tokens=output_tokens, **bound)
    if kind == "poisson":
        return poisson(rate_per_s, **common)
    if kind == "gamma":
        return gamma(rate_per_s, cv, **common)
    raise ValueError(f"unknown arrival process {kind!r}")


@dataclass(frozen=True)
class Shaping:
    """How a request list is turned into what is sent (see `shape` for the order)."""

    tier_mix: dict[str, float] | None = None  # None keeps each request's own tier
    time_scale: float = 1.0  # arrival times are multiplied by this (0.5 = twice the rate)
    target_rate_per_s: float | None = None  # instead of time_scale: rescale to this mean rate
    max_requests: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    slo_ttft_ms: float | None = None  # overrides every tier's TTFT target
    slo_tpot_ms: float | None = None
    seed: int = 0


def shape(reqs: Sequence[TraceRequest], s: Shaping) -> list[RequestSpec]:
    """First max_requests -> tier mix (exact counts over what is sent) -> time scaling -> length caps -> SLO
    targets; the first request arrives at 0 ms (run start)."""
    out = sorted(reqs, key=lambda r: r.arrival_ms)
    if s.max_requests is not None:
        out = out[: s.max_requests]
    if s.tier_mix is not None and out:
        out = assign_tiers(out, s.tier_mix, seed=s.seed)
    if s.target_rate_per_s is not None:
        out = scale_to_rate(out, s.target_rate_per_s)
    elif s.time_scale != 1.0:
        out = scale_time(out, s.time_scale)
    if out and out[0].arrival_ms > 0:  # a windowed slice starts the run at its first request
        t0 = out[0].arrival_ms
        out = [dataclasses.replace(r, arrival_ms=r.arrival_ms - t0) for r in out]
    specs = []
    width = max(4, len(str(len(out))))
    for i, r in enumerate(out):
        slo = resolve_slo(r.tier, s.slo_ttft_ms, s.slo_tpot_ms)
        specs.append(
            RequestSpec(
                request_id=f"req-{i:0{width}d}",
                arrival_ms=r.arrival_ms,
                prompt_tokens=min(r.prompt_tokens, s.max_prompt_tokens or r.prompt_tokens),
                output_tokens=min(r.output_tokens, s.max_output_tokens or r.output_tokens),
                tier=slo.tier,
                ttft_slo_ms=slo.ttft_ms,
                tpot_slo_ms=slo.tpot_ms,
                weight=slo.weight,
            )
        )
    return specs
