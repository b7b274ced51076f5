"""Smoke: `nitsum bench fidelity` against a real `nitsum up` (one session, a handful of requests) writes its files,
calibrates on the odd rows, joins the services' spans to the requests, and a replay of what it wrote gives the same
figures. Checks structure and consistency, never an error threshold (this is a benchmark)."""

from __future__ import annotations

import csv
import json

import pytest

from nitsum_load import bench_fidelity as bf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_live_fidelity_run_writes_calibration_spans_and_replays(tmp_path, capsys):
    trace = tmp_path / "conv.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    # Outputs of 24-26 tokens: a short output on a busy machine often reaches the client in one chunk (TPOT 0),
    # and calibration needs some request with a TPOT.
    rows += [f"2023-11-16 18:15:{i:02d}.0000000,{20 + 9 * i},{24 + i % 3}" for i in range(8)]
    trace.write_text("\r\n".join(rows) + "\r\n")
    out = tmp_path / "out"
    args = ["--trace", str(trace), "--requests", "4", "--rate", "4", "--seeds", "2"]
    assert bf.main([*args, "--out", str(out)]) == 0
    first = capsys.readouterr().out
    result = json.loads((out / "fidelity.json").read_text())
    (cal,) = result["calibrations"]
    assert cal["requests"] == 4 and cal["path_samples"] == 4  # the odd rows
    assert cal["ratios_tried"][0] == 1.0 and len(cal["ratios_tried"]) == bf.FIXED_POINT_ROUNDS + 1
    assert all(x >= 0 for x in cal["service_model"]["path_ms"])
    for name in ("live", "live-calibration"):
        assert len((out / "session-0" / name / "requests.jsonl").read_text().splitlines()) == 4
    with (out / "path.csv").open() as f:
        breakdown = list(csv.DictReader(f))
    assert len(breakdown) == 8  # every request found its gateway, coordinator and worker spans
    assert all(float(r["worker_span_ms"]) > 0 for r in breakdown)
    assert "where live time goes" in first
    with (out / "requests.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4  # the scored (even) rows
    # Replaying what was written recomputes the same simulator figures from the same live records.
    assert bf.main(["--replay", str(out), "--seeds", "2", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "fidelity.json").read_text())
    assert again["service_rows"] == result["service_rows"] and again["rows"] == result["rows"]
