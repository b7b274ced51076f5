"""A load that shifts: phases back to back, each a Poisson stream with its own rate and tier mix.

Each phase draws its interactive requests' lengths from one trace and its background requests' lengths from
another (with replacement, as `poisson(lengths=...)`), so an interactive surge can carry the long prompts of
a coding assistant while a batch window carries a bulk service's lengths. Deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nitsum.workloads.arrivals import poisson
from nitsum.workloads.request import TraceRequest


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    rate_per_s: float
    interactive_fraction: float

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or not self.rate_per_s > 0 or not 0.0 <= self.interactive_fraction <= 1.0:
            raise ValueError(f"phase {self.name!r}: duration and rate must be > 0, the interactive fraction in [0, 1]")


def phase_bounds(phases: Sequence[Phase]) -> list[tuple[str, float, float]]:
    """(name, start ms, end ms) of each phase."""
    out, t = [], 0.0
    for p in phases:
        out.append((p.name, t, t + p.duration_s * 1000.0))
        t += p.duration_s * 1000.0
    return out


def phased(
    phases: Sequence[Phase],
    interactive_lengths: Sequence[TraceRequest],
    background_lengths: Sequence[TraceRequest],
    seed: int = 0,
) -> list[TraceRequest]:
    """The phases' requests, sorted by arrival; `source` names the phase ("phase:<name>")."""
    out: list[TraceRequest] = []
    for index, (p, (_, start, _)) in enumerate(zip(phases, phase_bounds(phases))):
        for tier, fraction, lengths, salt in (
            ("interactive", p.interactive_fraction, interactive_lengths, 1),
            ("background", 1.0 - p.interactive_fraction, background_lengths, 2),
        ):
            if fraction <= 0:
                continue
            reqs = poisson(
                p.rate_per_s * fraction,
                duration_s=p.duration_s,
                seed=seed * 1000 + index * 10 + salt,
                lengths=lengths,
                tier=tier,
            )
            out.extend(
                TraceRequest(
                    start + r.arrival_ms, r.prompt_tokens, r.output_tokens, tier, r.prefix_hash_ids, f"phase:{p.name}"
                )
                for r in reqs
            )
    out.sort(key=lambda r: (r.arrival_ms, r.tier))
    return out


__all__ = ["Phase", "phase_bounds", "phased"]
