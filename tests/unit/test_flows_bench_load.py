"""The `nitsum bench flows` testbed loads: urgency and size aligned (SJF's best case) or drawn apart."""

from __future__ import annotations

import pytest

from nitsum.bench.flows import generated_load


def _sizes(load, tier):
    return [r["reuse_bytes"] + r["p2d_bytes"] for r in load if r["tier"] == tier]


def test_aligned_urgent_requests_are_the_small_ones_independent_ones_are_not():
    aligned = generated_load(0, 80, 20.0)
    assert max(_sizes(aligned, "interactive")) < min(_sizes(aligned, "background"))
    independent = generated_load(0, 80, 20.0, mix="independent")
    urgent, loose = _sizes(independent, "interactive"), _sizes(independent, "background")
    assert urgent and loose and max(urgent) > min(loose)  # some urgent request is bigger than some loose one
    for load in (aligned, independent):  # the SLO follows each request's own unloaded time, 2x or 4x
        for r in load:
            alone = (r["reuse_bytes"] + r["p2d_bytes"]) / (20e6 / 8 / 1000) + r["compute_ms"]
            assert r["slo_ms"] == pytest.approx(alone * (2.0 if r["tier"] == "interactive" else 4.0), abs=1e-3)


def test_an_unknown_mix_is_refused():
    with pytest.raises(ValueError, match="mix"):
        generated_load(0, 4, 20.0, mix="sjf-friendly")
