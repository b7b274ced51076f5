"""The gateway's SLO compliance gauge follows the shared definition: met / every request that ended."""

from nitsum.metrics import make_record, summarize_tier
from nitsum.policy.tiers import SloTarget
from nitsum.telemetry.metrics import Metrics
from nitsum_services.gateway.slo import SloAccounting

SLO = SloTarget(tier="interactive", ttft_ms=200.0, tpot_ms=25.0, weight=10.0)


def ratio(acc: SloAccounting) -> float:
    return acc.metrics.registry.get_sample_value("nitsum_slo_compliance_ratio", {"tier": "interactive"})


def test_failed_and_rejected_requests_are_misses():
    acc = SloAccounting(Metrics("gateway"))
    assert (
        acc.finished(SLO, arrival_s=10.0, first_token_s=10.1, finish_s=10.3, output_tokens=11) is True
    )  # 100 ms, 20 ms
    assert ratio(acc) == 1.0
    acc.outcome("interactive", "rejected")
    acc.outcome("interactive", "error")
    assert ratio(acc) == 1 / 3
    assert acc.finished(SLO, arrival_s=10.0, first_token_s=10.3, finish_s=10.4, output_tokens=2) is False  # TTFT 300 ms
    assert ratio(acc) == 1 / 4
    assert acc.metrics.registry.get_sample_value("nitsum_goodput_requests_total", {"tier": "interactive"}) == 1.0


def test_gauge_equals_the_load_generators_attainment_for_the_same_history():
    acc = SloAccounting(Metrics("gateway"))
    history = [  # (first token s, finish s, tokens, error)
        (10.05, 10.2, 8, None),
        (10.25, 10.3, 3, None),  # TTFT 250 ms: miss
        (10.05, 10.9, 5, None),  # TPOT 212 ms: miss
        (None, None, 0, "http_503"),
        (10.01, 10.02, 1, None),  # one token: TPOT undefined, met
    ]
    records = []
    for i, (first, finish, tokens, error) in enumerate(history):
        if error is None:
            acc.finished(SLO, 10.0, first, finish, tokens)
        else:
            acc.outcome("interactive", "rejected")
        records.append(
            make_record(
                request_id=str(i),
                tier="interactive",
                send_ms=10_000.0,
                first_token_ms=None if first is None else first * 1000.0,
                finish_ms=None if finish is None else finish * 1000.0,
                output_tokens=tokens,
                prompt_tokens=4,
                error=error,
            )
        )
    assert ratio(acc) == summarize_tier("interactive", records, 1.0).slo_attainment == 2 / 5
