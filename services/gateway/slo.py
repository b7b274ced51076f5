"""Per-tier SLO accounting at the gateway (the live side of the shared metric definitions)."""

from __future__ import annotations

from nitsum.policy.tiers import SloTarget
from nitsum.telemetry.metrics import Metrics


class SloAccounting:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.finished_by_tier: dict[str, int] = {}
        self.met_by_tier: dict[str, int] = {}
        # Create the families up front so that /metrics lists them before the first request.
        for make in (metrics.requests_total, metrics.goodput_requests_total, metrics.ttft_seconds, metrics.tpot_seconds, metrics.slo_compliance_ratio):
            make()

    def outcome(self, tier: str, outcome: str) -> None:
        self.metrics.requests_total().labels(tier=tier, outcome=outcome).inc()

    def finished(self, slo: SloTarget, arrival_s: float, first_token_s: float | None, finish_s: float, output_tokens: int) -> bool:
        """Record one finished request; returns whether it met both its TTFT and TPOT targets."""
        tier = slo.tier
        self.outcome(tier, "ok")
        if first_token_s is None:
            met = False
        else:
            ttft_s = first_token_s - arrival_s
            self.metrics.ttft_seconds().labels(tier=tier).observe(ttft_s)
            met = ttft_s * 1000.0 <= slo.ttft_ms
            if output_tokens > 1:
                tpot_s = (finish_s - first_token_s) / (output_tokens - 1)
                self.metrics.tpot_seconds().labels(tier=tier).observe(tpot_s)
                met = met and tpot_s * 1000.0 <= slo.tpot_ms
        self.finished_by_tier[tier] = self.finished_by_tier.get(tier, 0) + 1
        if met:
            self.met_by_tier[tier] = self.met_by_tier.get(tier, 0) + 1
            self.metrics.goodput_requests_total().labels(tier=tier).inc()
        self.metrics.slo_compliance_ratio().labels(tier=tier).set(self.met_by_tier.get(tier, 0) / self.finished_by_tier[tier])
        return met
