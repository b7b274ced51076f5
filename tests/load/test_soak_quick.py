"""A very short soak on the live CPU mesh (own nats-server, `nitsum up --devices 2`): one NATS restart and one
worker SIGKILL under Poisson load; nothing sent is lost and every report file is written."""

from __future__ import annotations

import csv
import json

import pytest

from nitsum_load.bench_soak import main
from nitsum_load.soak_core import NATS_RESTART, WORKER_KILL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FILES = (
    "soak.md",
    "soak.json",
    "soak_series.csv",
    "soak_requests.csv",
    "soak.png",
    "load/summary.json",
    "load/requests.jsonl",
)


def test_quick_soak_loses_nothing_and_writes_its_report(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("NITSUM_HOME", str(tmp_path / "home"))  # `nitsum up` writes current.json there
    monkeypatch.setenv("NITSUM_MODEL", str(tiny_model_dir))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    out = tmp_path / "soak"
    # 30 s at a fixed rate (no ramp): NATS restarts at 7.5 s, worker-0 is killed at 15 s.
    code = main(
        ["--quick", "--minutes", "0.5", "--kill-every", "0.25", "--rate", "3", "--warmup-s", "5", "--out", str(out)]
    )
    assert code == 0
    for name in FILES:
        assert (out / name).is_file(), name
    result = json.loads((out / "soak.json").read_text())
    counts = result["counts"]
    assert counts["lost"] == 0, counts
    assert (
        counts["sent"] > 0
        and counts["sent"]
        == counts["completed"] + counts["failed_in_windows"] + counts["failed_outside_windows"] + counts["lost"]
    )
    assert [(f["kind"], f["target"]) for f in result["faults"]] == [
        (NATS_RESTART, "nats-server"),
        (WORKER_KILL, "worker-0"),
    ]
    assert all(f["recovered_s"] is not None for f in result["faults"]), result["faults"]
    with (out / "soak_series.csv").open() as f:
        rows = list(csv.DictReader(f))
    # Every service exposes nitsum_asyncio_tasks; the killed worker shows up under two pids.
    for service in ("gateway", "coordinator", "flow-scheduler", "worker-0", "worker-1"):
        assert any(r["process"] == service and r["asyncio_tasks"] for r in rows), service
    assert len({r["pid"] for r in rows if r["process"] == "worker-0"}) == 2
    with (out / "soak_requests.csv").open() as f:
        assert sum(1 for _ in csv.DictReader(f)) == counts["sent"]
