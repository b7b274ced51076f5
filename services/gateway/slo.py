"""Per-tier SLO accounting at the gateway (the live side of the shared metric definitions).

`nitsum_slo_compliance_ratio{tier}` is SLO attainment as `nitsum.metrics` defines it for the load
generator and the simulator: requests that met both targets / every request that ended, so a rejected,
failed or cancelled request is a miss. Whether a finished request met its SLO is decided by
`RequestRecord.slo_met`, the same code the load generator and the simulator use.
"""

from __future__ import annotations

from nitsum.metrics import RequestRecord
from nitsum.policy.tiers import SloTarget
from nitsum.telemetry.metrics import Metrics


class SloAccounting:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.ended_by_tier: dict[str, int] = {}
        self.met_by_tier: dict[str, int] = {}
        # Create the families up front so that /metrics lists them before the first request.
        for make in (
            metrics.requests_total,
            metrics.goodput_requests_total,
            metrics.ttft_seconds,
            metrics.tpot_seconds,
            metrics.slo_compliance_ratio,
        ):
            make()

    def outcome(self, tier: str, outcome: str) -> None:
        """A request that ended with `outcome` ('rejected', 'error', 'cancelled'): a miss; `finished`
        records the 'ok' ones."""
        self.metrics.requests_total().labels(tier=tier, outcome=outcome).inc()
        self._ended(tier, met=False)

    def finished(
        self, slo: SloTarget, arrival_s: float, first_token_s: float | None, finish_s: float, output_tokens: int
    ) -> bool:
        """Record one finished request; returns whether it met both its TTFT and TPOT targets."""
        tier = slo.tier
        self.metrics.requests_total().labels(tier=tier, outcome="ok").inc()
        record = RequestRecord(
            request_id="",
            tier=tier,
            ttft_slo_ms=slo.ttft_ms,
            tpot_slo_ms=slo.tpot_ms,
            weight=slo.weight,
            send_ms=arrival_s * 1000.0,
            first_token_ms=None if first_token_s is None else first_token_s * 1000.0,
            finish_ms=finish_s * 1000.0,
            output_tokens=output_tokens,
            prompt_tokens=0,
        )
        if record.ttft_ms is not None:
            self.metrics.ttft_seconds().labels(tier=tier).observe(record.ttft_ms / 1000.0)
        if record.tpot_ms is not None:
            self.metrics.tpot_seconds().labels(tier=tier).observe(record.tpot_ms / 1000.0)
        met = record.slo_met
        if met:
            self.metrics.goodput_requests_total().labels(tier=tier).inc()
        self._ended(tier, met)
        return met

    def _ended(self, tier: str, met: bool) -> None:
        self.ended_by_tier[tier] = self.ended_by_tier.get(tier, 0) + 1
        if met:
            self.met_by_tier[tier] = self.met_by_tier.get(tier, 0) + 1
        self.metrics.slo_compliance_ratio().labels(tier=tier).set(
            self.met_by_tier.get(tier, 0) / self.ended_by_tier[tier]
        )
