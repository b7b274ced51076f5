"""Smoke: `nitsum bench policy --live` replays one trace slice against two policies and writes the comparison.

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
