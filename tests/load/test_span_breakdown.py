"""load/profile_live/span_breakdown.py: the gaps between a request's gateway, coordinator and worker spans."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "load" / "profile_live" / "span_breakdown.py"
spec = importlib.util.spec_from_file_location("span_breakdown", SCRIPT)
sb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)


def span(trace: str, name: str, start_ms: float, end_ms: float) -> str:
    ns = 1_000_000
    return json.dumps(
        {"trace_id": trace, "name": name, "start_unix_ns": int(start_ms * ns), "end_unix_ns": int(end_ms * ns)}
    )


def test_gaps_of_a_request_served_once_and_nothing_of_a_rerouted_one(tmp_path, capsys):
    lines = [
        span("a", "gateway.request", 0, 20),
        span("a", "coordinator.route", 4, 11),
        span("a", "worker.generate", 7, 15),
        # re-routed: two worker spans, left out
        span("b", "gateway.request", 0, 50),
        span("b", "coordinator.route", 1, 2),
        span("b", "worker.generate", 2, 10),
        span("b", "worker.generate", 12, 40),
    ]
    gaps = sb.breakdown(lines)
    assert {k: v for k, v in gaps.items()} == {
        "gateway span (whole request)": [20.0],
        "gateway start -> coordinator start": [4.0],
        "coordinator span (route + worker ack)": [7.0],
        "coordinator start -> worker start": [3.0],
        "worker span (accepted -> last token)": [8.0],
        "worker end -> gateway end": [5.0],
    }
    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert sb.main([str(path)]) == 0
    assert "1 requests" in capsys.readouterr().out
    path.write_text(lines[3] + "\n")
    assert sb.main([str(path)]) == 1
