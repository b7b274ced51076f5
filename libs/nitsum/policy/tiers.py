"""SLO tiers: the tier table and per-request SLO targets (ALGORITHMS.md §0)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    name: str
    ttft_ms: float
    tpot_ms: float
    weight: float


INTERACTIVE = Tier("interactive", ttft_ms=200.0, tpot_ms=25.0, weight=10.0)
BACKGROUND = Tier("background", ttft_ms=10_000.0, tpot_ms=100.0, weight=1.0)

DEFAULT_TIERS: dict[str, Tier] = {t.name: t for t in (INTERACTIVE, BACKGROUND)}
# Shedding order: the first tier in this tuple is shed first.
SHED_ORDER: tuple[str, ...] = ("background", "interactive")


class UnknownTierError(ValueError):
    """A request named a tier that is not in the tier table."""


@dataclass(frozen=True)
class SloTarget:
    """The targets one request is held to: its tier's defaults unless overridden per request."""

    tier: str
    ttft_ms: float
    tpot_ms: float
    weight: float


def resolve_slo(
    tier: str | None,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    tiers: dict[str, Tier] = DEFAULT_TIERS,
    default_tier: str = "interactive",
) -> SloTarget:
    """Targets for a request: tier defaults, overridden by explicit per-request values."""
    name = default_tier if tier is None else tier
    if name not in tiers:
        raise UnknownTierError(f"unknown tier {name!r}; known tiers: {', '.join(sorted(tiers))}")
    base = tiers[name]
    for label, value in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)):
        if value is not None and not value > 0:
            raise ValueError(f"{label} must be > 0, got {value!r}")
    return SloTarget(
        tier=name,
        ttft_ms=base.ttft_ms if ttft_ms is None else float(ttft_ms),
        tpot_ms=base.tpot_ms if tpot_ms is None else float(tpot_ms),
        weight=base.weight,
    )
