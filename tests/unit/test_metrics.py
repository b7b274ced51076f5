"""nitsum.metrics on a synthetic lifecycle log whose answers are computed by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nitsum.metrics import (
    OVERALL,
    UNFINISHED,
    Distribution,
    RequestRecord,
    make_record,
    percentile,
    sent_between,
    summarize,
    window_s,
)
from nitsum.policy.tiers import UnknownTierError


def rec(rid, tier, send, first, finish, out, *, error=None, times=(), prompt=10):
    return make_record(
        request_id=rid,
        tier=tier,
        send_ms=send,
        first_token_ms=first,
        finish_ms=finish,
        output_tokens=out,
        prompt_tokens=prompt,
        token_times_ms=times,
        error=error,
    )


# interactive: TTFT 200 ms, TPOT 25 ms, weight 10; background: TTFT 10 s, TPOT 100 ms, weight 1.
LOG = [
    # A: TTFT 100, TPOT (180-100)/4 = 20 -> meets both.
    rec("A", "interactive", 0, 100, 180, 5, times=(100, 120, 140, 160, 180)),
    # B: TTFT 300 (miss), TPOT 10.
    rec("B", "interactive", 100, 400, 420, 3),
    # C: TTFT 150, TPOT 30 (miss).
    rec("C", "interactive", 200, 350, 380, 2),
    # D: rejected before any token.
    rec("D", "interactive", 300, None, None, 0, error="http_429"),
    # E: TTFT 5000, TPOT 50 -> meets both.
    rec("E", "background", 0, 5000, 5500, 11),
    # F: one output token: TPOT undefined, counts as met; TTFT 200 -> meets both.
    rec("F", "background", 1000, 1200, 1200, 1),
    # G: first token after 100 ms, then the stream broke.
    rec("G", "background", 2000, 2100, None, 3, error="stream_error", times=(2100, 2110, 2130)),
    # H: sent at 10 s, nothing came back before the cut-off.
    rec("H", "background", 10_000, None, None, 0),
]


def test_record_derived_values():
    a, b, c, d, e, f, g, h = LOG
    assert (a.ttft_ms, a.tpot_ms, a.slo_met) == (100, 20, True)
    assert (b.ttft_met, b.tpot_met, b.slo_met) == (False, True, False)
    assert (c.ttft_met, c.tpot_met, c.slo_met) == (True, False, False)
    assert (d.ttft_ms, d.outcome, d.slo_met) == (None, "http_429", False)
    assert (f.tpot_ms, f.tpot_met, f.slo_met) == (None, True, True)
    assert (g.ttft_met, g.tpot_met, g.outcome) == (True, False, "stream_error")
    assert (h.outcome, h.succeeded, h.last_event_ms) == (UNFINISHED, False, 10_000)
    assert (e.weight, a.weight, a.ttft_slo_ms, e.tpot_slo_ms) == (1.0, 10.0, 200.0, 100.0)


def test_report_per_tier_hand_computed():
    report = summarize(LOG)
    assert report.duration_s == 10.0  # first send 0 ms .. last event 10 000 ms
    assert list(report.tiers) == ["interactive", "background"]

    it = report.tiers["interactive"]
    assert (it.requests, it.succeeded, it.failed, it.unfinished) == (4, 3, 1, 0)
    assert (it.slo_met, it.ttft_met, it.tpot_met) == (1, 2, 2)
    assert (it.slo_attainment, it.ttft_attainment, it.tpot_attainment) == (0.25, 0.5, 0.5)
    assert it.goodput_rps == pytest.approx(0.1, rel=1e-12)
    assert it.weighted_goodput_rps == pytest.approx(1.0, rel=1e-12)
    assert it.throughput_rps == pytest.approx(0.3, rel=1e-12)
    assert it.output_tokens_per_s == pytest.approx(1.0, rel=1e-12)  # (5 + 3 + 2) / 10 s
    # TTFT sample [100, 150, 300]: p90 rank 1.8 -> 150 + 0.8 * 150.
    assert it.ttft_ms.count == 3
    assert it.ttft_ms.p50 == 150
    assert it.ttft_ms.p90 == pytest.approx(270, rel=1e-12)
    assert it.ttft_ms.p99 == pytest.approx(297, rel=1e-12)
    assert it.ttft_ms.mean == pytest.approx(550 / 3, rel=1e-12)
    assert it.ttft_ms.max == 300
    # TPOT sample [10, 20, 30].
    assert (it.tpot_ms.count, it.tpot_ms.p50) == (3, 20)
    assert it.tpot_ms.p90 == pytest.approx(28, rel=1e-12)
    assert it.tpot_ms.p99 == pytest.approx(29.8, rel=1e-12)
    assert (it.itl_ms.count, it.itl_ms.p50, it.itl_ms.max) == (4, 20, 20)
    assert it.errors == {"http_429": 1}

    bg = report.tiers["background"]
    assert (bg.requests, bg.succeeded, bg.failed, bg.unfinished) == (4, 2, 1, 1)
    assert (bg.slo_met, bg.slo_attainment) == (2, 0.5)
    assert bg.goodput_rps == pytest.approx(0.2, rel=1e-12)
    assert bg.weighted_goodput_rps == pytest.approx(0.2, rel=1e-12)
    # TTFT sample [100, 200, 5000].
    assert bg.ttft_ms.p50 == 200
    assert bg.ttft_ms.p90 == pytest.approx(4040, rel=1e-12)
    assert bg.ttft_ms.p99 == pytest.approx(4904, rel=1e-12)
    # Only E has a TPOT (F has one token, G failed).
    assert (bg.tpot_ms.count, bg.tpot_ms.p50, bg.tpot_ms.p99) == (1, 50, 50)
    assert bg.itl_ms.p50 == 15 and bg.itl_ms.p90 == pytest.approx(19, rel=1e-12)
    assert bg.errors == {"stream_error": 1, UNFINISHED: 1}

    ov = report.overall
    assert (ov.tier, ov.requests, ov.slo_met, ov.slo_attainment) == (OVERALL, 8, 3, 0.375)
    assert ov.goodput_rps == pytest.approx(0.3, rel=1e-12)
    assert ov.weighted_goodput_rps == pytest.approx(1.2, rel=1e-12)  # (10 + 1 + 1) / 10 s
    assert ov.errors == {"http_429": 1, "stream_error": 1, UNFINISHED: 1}
    assert ov.ttft_ms.count == 6


def test_explicit_duration_scales_rates_only():
    report = summarize(LOG, duration_s=20.0)
    assert report.duration_s == 20.0
    assert report.overall.goodput_rps == pytest.approx(0.15, rel=1e-12)
    assert report.overall.slo_attainment == 0.375


def test_report_to_dict_is_json_and_stable():
    d = summarize(LOG).to_dict()
    again = json.loads(json.dumps(d))
    assert again == d
    assert again["tiers"]["interactive"]["ttft_ms"]["p50"] == 150
    assert again["overall"]["errors"] == {"http_429": 1, "stream_error": 1, "unfinished": 1}


def test_empty_and_zero_window():
    empty = summarize([])
    assert (empty.duration_s, empty.tiers, empty.overall.requests) == (0.0, {}, 0)
    assert (empty.overall.slo_attainment, empty.overall.goodput_rps) == (None, None)
    assert empty.overall.ttft_ms == Distribution(0, None, None, None, None, None)
    one = summarize([rec("x", "interactive", 5, 5, 5, 1)])
    assert (one.duration_s, one.overall.slo_met, one.overall.goodput_rps) == (0.0, 1, None)


def test_unknown_tiers_sorted_after_known():
    r1 = RequestRecord(
        request_id="z",
        tier="zeta",
        ttft_slo_ms=1,
        tpot_slo_ms=1,
        weight=2,
        send_ms=0,
        first_token_ms=1,
        finish_ms=1,
        output_tokens=1,
        prompt_tokens=1,
    )
    r0 = RequestRecord(
        request_id="a",
        tier="alpha",
        ttft_slo_ms=1,
        tpot_slo_ms=1,
        weight=2,
        send_ms=0,
        first_token_ms=2,
        finish_ms=2,
        output_tokens=1,
        prompt_tokens=1,
    )
    report = summarize([r1, r0, LOG[4]])
    assert list(report.tiers) == ["background", "alpha", "zeta"]
    assert (report.tiers["alpha"].slo_met, report.tiers["zeta"].slo_met) == (0, 1)


def test_record_roundtrip_and_make_record_overrides():
    for r in LOG:
        assert RequestRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    r = make_record(
        request_id="q",
        tier="background",
        send_ms=0,
        first_token_ms=1,
        finish_ms=2,
        output_tokens=2,
        prompt_tokens=3,
        ttft_slo_ms=50,
        tpot_slo_ms=None,
    )
    assert (r.ttft_slo_ms, r.tpot_slo_ms, r.weight) == (50.0, 100.0, 1.0)
    assert (
        make_record(
            request_id="n", tier=None, send_ms=0, first_token_ms=None, finish_ms=None, output_tokens=0, prompt_tokens=0
        ).tier
        == "interactive"
    )
    with pytest.raises(UnknownTierError):
        make_record(
            request_id="u",
            tier="gold",
            send_ms=0,
            first_token_ms=None,
            finish_ms=None,
            output_tokens=0,
            prompt_tokens=0,
        )


def test_record_rejects_time_travel():
    with pytest.raises(AssertionError, match="precede the send"):
        rec("bad", "interactive", 100, 50, 200, 2)


def test_percentile_linear_interpolation_by_hand():
    assert percentile([], 50) is None
    assert percentile([7], 99) == 7
    assert percentile([4, 1, 3, 2], 50) == 2.5  # rank 1.5 between 2 and 3
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile(range(1, 101), 99) == pytest.approx(99.01, rel=1e-12)  # rank 98.01
    with pytest.raises(ValueError):
        percentile([1], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60), st.floats(0, 100))
def test_percentile_matches_numpy_linear(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q, method="linear")), rel=1e-9, abs=1e-6)


def test_window_s():
    assert window_s([]) == 0.0
    assert window_s(LOG[:3]) == 0.42  # send 0 .. B finish 420 ms


def test_sent_between_for_warmup_exclusion():
    assert [r.request_id for r in sent_between(LOG, 100, 1000)] == ["B", "C", "D"]
    report = summarize(sent_between(LOG, 100, 1000), duration_s=0.9)
    assert (report.overall.requests, report.overall.slo_met) == (3, 0)
