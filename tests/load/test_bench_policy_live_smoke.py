"""Smoke: `nitsum bench policy --live` replays one trace slice against two policies and writes the comparison;
the default `--live` (the phased workload) runs the P/D layout.

Uses a synthetic two-column trace file (so it runs where /work/shared does not exist), the tiny model, and
two policies; checks the report files and fields, never a goodput threshold (this is a benchmark)."""

from __future__ import annotations

import json

import pytest

from nitsum.bench.policy import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_live_policy_bench_writes_a_comparison(tmp_path):
    trace = tmp_path / "conv.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:{i:02d}.0000000,{40 + 7 * i},{8 + i % 5}" for i in range(10)]
    trace.write_text("\r\n".join(rows) + "\r\n")
    out = tmp_path / "out"
    code = main(
        [
            "--live",
            "--trace",
            str(trace),
            "--requests",
            "10",
            "--target-rate",
            "4",
            "--model",
            "tiny",
            "--policies",
            "adaptive,static-tp:2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["policies"]) == ["adaptive", "static-tp:2"]
    for name in ("adaptive", "static-tp-2"):
        assert (out / name / "summary.json").is_file() and (out / name / "requests.jsonl").is_file()
    for pol in report["policies"].values():
        assert sum(t["requests"] for t in pol["tiers"].values()) == 10
        assert set(pol["tiers"]) <= {"interactive", "background"}
        assert {"goodput_rps", "slo_attainment", "weighted_goodput_rps"} <= pol["tiers"]["background"].keys()
    assert "static-tp:2" in report["ratios"]["background"]


def test_live_phased_bench_runs_the_pd_layout_and_scores_it(tmp_path):
    """The default `--live` run (the phased workload, 1 s phases) with the P/D split and adaptive: the replay
    starts on `disagg`'s layout with its roles, every layout sample shows it, and the oracle scores it."""
    out = tmp_path / "out"
    code = main(["--live", "--phase-s", "1", "--policies", "disagg,adaptive", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["policies"]) == ["disagg", "adaptive"]
    pd, adaptive = report["policies"]["disagg"], report["policies"]["adaptive"]
    assert pd["layout"] == "[0 TP1 prefill][1 TP1 decode]" and adaptive["layout"] is None
    assert pd["layouts"] and {lay for _, lay in pd["layouts"]} == {"TP1p+TP1d"} and pd["changes"] == 0
    assert report["best_static"] == "disagg"
    assert set(report["oracle"]["per_phase"].values()) == {"disagg"}
    for pol in report["policies"].values():
        assert sum(t["requests"] for t in pol["tiers"].values()) == report["requests"]
        assert list(pol["phases"]) == ["surge", "batch", "mixed", "surge2"]
        assert len(pol["load_average"]) == 2
    assert (out / "disagg" / "summary.json").is_file() and (out / "adaptive" / "requests.jsonl").is_file()
