"""Where a request's time goes, from the mesh's own traces: `python load/profile_live/span_breakdown.py
RUN_DIR/spans.jsonl` (the spans `nitsum up` writes when no OTLP endpoint is set).

For every trace holding a `gateway.request`, a `coordinator.route` and one `worker.generate` span (a request
served once, not re-routed), the gaps between their starts and ends, p50 / p90 / mean in ms: the gateway's
intake before the coordinator sees the submission, the coordinator's routing (its span ends once the worker has
acknowledged the run), the worker's span (from its accepting the run to the last token), and from the worker's
last token to the gateway's answer (frame, decode, HTTP).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

GAPS = (
    ("gateway span (whole request)", "gateway.request", "start", "gateway.request", "end"),
    ("gateway start -> coordinator start", "gateway.request", "start", "coordinator.route", "start"),
    ("coordinator span (route + worker ack)", "coordinator.route", "start", "coordinator.route", "end"),
    ("coordinator start -> worker start", "coordinator.route", "start", "worker.generate", "start"),
    ("worker span (accepted -> last token)", "worker.generate", "start", "worker.generate", "end"),
    ("worker end -> gateway end", "worker.generate", "end", "gateway.request", "end"),
)


def breakdown(lines) -> dict[str, list[float]]:
    traces: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for line in lines:
        if line.strip():
            span = json.loads(line)
            traces[span["trace_id"]][span["name"]].append(span)
    gaps: dict[str, list[float]] = {name: [] for name, *_ in GAPS}
    for spans in traces.values():
        if any(len(spans.get(n, ())) != 1 for n in ("gateway.request", "coordinator.route", "worker.generate")):
            continue
        for name, a, a_end, b, b_end in GAPS:
            t0 = spans[a][0][f"{a_end}_unix_ns"]
            t1 = spans[b][0][f"{b_end}_unix_ns"]
            gaps[name].append((t1 - t0) / 1e6)
    return gaps


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        gaps = breakdown(f)
    n = len(next(iter(gaps.values())))
    if n == 0:
        print(f"{argv[0]}: no trace with one gateway, coordinator and worker span", file=sys.stderr)
        return 1
    print(f"{n} requests (ms)                         p50      p90     mean")
    for name, values in gaps.items():
        values.sort()
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        print(f"{name:38s} {statistics.median(values):7.2f}  {p90:7.2f}  {statistics.mean(values):7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
