"""Goodput accounting: TTFT/TPOT definitions and 'both targets met', tier-weighted."""

from nitsum.policy.goodput import RequestOutcome, slo_met, summarize_goodput, tpot_ms, ttft_ms


def outcome(rid, tier="interactive", weight=10.0, first=150.0, finish=150.0 + 24.0 * 9, tokens=10):
    return RequestOutcome(rid, tier, weight, 200.0, 25.0, 0.0, first, finish, tokens)


def test_definitions():
    o = outcome("a")
    assert ttft_ms(o) == 150.0
    assert tpot_ms(o) == 24.0  # (finish − first) / (tokens − 1)
    assert tpot_ms(outcome("one", tokens=1)) == 0.0
    assert ttft_ms(outcome("none", first=None, finish=None)) is None


def test_both_targets_must_be_met():
    assert slo_met(outcome("ok"))
    assert not slo_met(outcome("late-first", first=201.0, finish=201.0 + 24.0 * 9))
    assert not slo_met(outcome("slow-tokens", finish=150.0 + 26.0 * 9))
    assert not slo_met(outcome("unfinished", finish=None))


def test_weighted_goodput_per_second_and_per_tier():
    outs = [
        outcome("i1"),
        outcome("i2", first=300.0, finish=400.0),
        outcome("b1", tier="background", weight=1.0),
        outcome("b2", tier="background", weight=1.0),
    ]
    s = summarize_goodput(outs, window_s=2.0)
    assert (s.met, s.finished) == (3, 4)
    assert s.goodput_rps == 1.5
    assert s.weighted_goodput_rps == (10.0 + 1.0 + 1.0) / 2.0
    assert s.attainment == 0.75
    assert s.met_by_tier == (("background", 2, 2), ("interactive", 1, 2))
