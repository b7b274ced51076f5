"""Diagnostics of `nitsum bench fidelity` (pure): where a live request's time goes, from the services' spans;
how far the live figures move under resampling; the per-request comparison rows."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from nitsum.metrics import RequestRecord, percentile, summarize

METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"))


def metric_values(report) -> list[float | None]:
    """The four compared figures of a report, in METRICS order."""
    return [getattr(getattr(report.overall, dist), stat) for dist, stat in METRICS]


# Where a live request's time goes, from the services' spans (gateway.request, coordinator.route,
# worker.generate; joined on the server's request id) placed on the load generator's clock.
PATH_PARTS = (
    "to_gateway_ms",
    "gateway_to_coordinator_ms",
    "coordinator_to_worker_ms",
    "worker_to_first_token_ms",
    "worker_span_ms",
    "last_token_lag_ms",
)


def path_breakdown(logs: list[dict], spans: list[dict], wall0_ms: float) -> list[dict[str, Any]]:
    """Per request with all three spans: client send -> gateway -> coordinator -> worker -> first token seen by
    the client, the worker's span (submit to last token published) and how late the client saw that last token."""
    by_id: dict[str, dict[str, dict]] = {}
    for sp in spans:
        rid = sp.get("attributes", {}).get("nitsum.request_id")
        if rid is not None:
            by_id.setdefault(rid, {}).setdefault(sp["name"], sp)  # first attempt's spans
    out = []
    for log in logs:
        got = by_id.get(log.get("server_request_id") or "", {})
        gw, co, wk = got.get("gateway.request"), got.get("coordinator.route"), got.get("worker.generate")
        if gw is None or co is None or wk is None or log.get("first_token_ms") is None:
            continue
        ms = lambda sp, key: sp[key] / 1e6 - wall0_ms  # noqa: E731 (a span time on the client's clock)
        # The coordinator's route span ends when the worker has acknowledged the run, after the worker's span
        # started: the coordinator's part is its span's start to the worker's.
        row = {
            "request_id": log["request_id"],
            "to_gateway_ms": ms(gw, "start_unix_ns") - log["dispatched_ms"],
            "gateway_to_coordinator_ms": ms(co, "start_unix_ns") - ms(gw, "start_unix_ns"),
            "coordinator_to_worker_ms": ms(wk, "start_unix_ns") - ms(co, "start_unix_ns"),
            "worker_to_first_token_ms": log["first_token_ms"] - ms(wk, "start_unix_ns"),
            "worker_span_ms": ms(wk, "end_unix_ns") - ms(wk, "start_unix_ns"),
            "last_token_lag_ms": None if log.get("finish_ms") is None else log["finish_ms"] - ms(wk, "end_unix_ns"),
        }
        out.append(row)
    return out


def format_breakdown(rows: list[dict[str, Any]]) -> str:
    parts = []
    for key in PATH_PARTS:
        xs = [r[key] for r in rows if r[key] is not None]
        if xs:
            parts.append(f"{key[:-3]} {percentile(xs, 50):.2f}/{percentile(xs, 90):.2f}")
    return f"where live time goes (p50/p90 ms over {len(rows)} requests): " + ", ".join(parts)


def bootstrap_intervals(
    records: list[RequestRecord],
    resamples: int = 200,
    seed: int = 0,
) -> list[tuple[float, float] | None]:
    """5th-95th percentile of each metric over resamples (with replacement) of the live evaluation requests: how
    far the live figure itself could move with another draw of as many requests under the same conditions."""
    rng = random.Random(seed)
    draws = [metric_values(summarize(rng.choices(records, k=len(records)))) for _ in range(resamples)]
    out: list[tuple[float, float] | None] = []
    for k in range(len(METRICS)):
        xs = sorted(v[k] for v in draws if v[k] is not None)
        out.append((xs[int(0.05 * (len(xs) - 1))], xs[int(0.95 * (len(xs) - 1))]) if xs else None)
    return out


def per_request_rows(
    live_records: list[RequestRecord],
    bare: list[RequestRecord],
    service: list[RequestRecord],
) -> list[dict[str, Any]]:
    """One row per evaluation request: its TTFT and TPOT live, simulated on the table, and with the service model."""
    rows = []
    for a, b, c in zip(live_records, bare, service):
        rows.append(
            {
                "request_id": a.request_id,
                "send_ms": a.send_ms,
                "prompt_tokens": a.prompt_tokens,
                "output_tokens": a.output_tokens,
                "ttft_live_ms": a.ttft_ms,
                "ttft_table_ms": b.ttft_ms,
                "ttft_service_ms": c.ttft_ms,
                "tpot_live_ms": a.tpot_ms,
                "tpot_table_ms": b.tpot_ms,
                "tpot_service_ms": c.tpot_ms,
                "live_chunks": len(set(a.token_times_ms)),
            }
        )
    return rows


def read_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
