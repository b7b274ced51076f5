"""Smoke: `nitsum bench reconfigure` (live) runs end to end on a small setting and writes its report.

Checks that the report holds every transition of the chain with its phases from the admin answer, the
stream measurements and the restart baseline's parts; never a timing threshold (this is a benchmark)."""

from __future__ import annotations

import json

import pytest

from nitsum_load.bench_reconfigure import main
from nitsum_load.reconfigure_core import CHAIN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_live_reconfigure_writes_a_report(tmp_path):
    out = tmp_path / "out"
    code = main(
        [
            "--model",
            "tiny",
            "--requests",
            "2",
            "--steady-tokens",
            "3",
            "--stream-timeout-s",
            "2",
            "--advance-timeout-s",
            "5",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "live"
    assert [r["transition"].split()[0] for r in report["rows"]] == [kind for kind, _, _ in CHAIN]
    assert [r["epoch"] for r in report["rows"]] == [1, 2, 3, 4, 5]  # every change went through
    for row in report["rows"]:
        assert row["prepare_ms"] > 0 and row["pause_ms"] > 0 and row["total_ms"] >= row["prepare_ms"]
        # The baseline leaves out a target whose set-topology did not answer on the restarted mesh (a known
        # hang, see the closing note of issue #4); the live changes themselves must all have gone through.
        assert row["admin_rtt_ms"] > 0 and (row["restart_ms"] is None or row["restart_ms"] > row["admin_rtt_ms"])
        assert {"stream_pause_ms", "stream_pause_steps", "streams_across", "speedup"} <= row.keys()
    restart = report["restart"]
    assert restart["boot_ms"] > 0 and restart["stop_ms"] > 0
    assert restart["store_reloaded_bytes"] > 0  # the restarted workers re-read the checkpoint
    assert set(restart["to_target_ms"]) <= {"2xTP2", "TP4"} and restart["to_target_ms"]
    assert any(row["restart_ms"] is not None for row in report["rows"])
    hist = report["coordinator_histogram_ms"]
    assert hist is not None and hist["total"]["count"] == 5 and hist["prepare"]["count"] == 5
    # The raw timeline and its plot: a window per change, every stream's tokens in arrival order.
    assert len(report["windows_ms"]) == 5 and all(s < e for s, e in report["windows_ms"])
    assert len(report["token_times_ms"]) == 2
    assert all(times == sorted(times) and len(times) > 5 for times in report["token_times_ms"])
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
