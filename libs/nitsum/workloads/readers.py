"""Readers for per-request traces: Azure LLM inference 2023 (CSV) and Mooncake FAST'25 (JSONL).

Both return requests sorted by arrival, with the first arrival at 0 ms.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
from pathlib import Path

from nitsum.workloads.request import TraceRequest

MOONCAKE_BLOCK_TOKENS = 512  # tokens per Mooncake hash_id block (SOURCE.md: len(hash_ids) == ceil(input/512))


def _azure_ticks(stamp: str) -> int:
    """100-ns ticks since 0001-01-01 of a naive `YYYY-MM-DD HH:MM:SS.fffffff` stamp (7 fractional digits).

    Integer arithmetic because a float of seconds since year 1 keeps only ~10 us, and the trace's 100-ns
    digit must survive; datetime.fromisoformat on 3.11 does not take 7 fractional digits either.
    """
    date_part, time_part = stamp.strip().split(" ")
    days = _dt.date.fromisoformat(date_part).toordinal()
    hh, mm, ss = time_part.split(":")
    whole, _, frac = ss.partition(".")
    seconds = days * 86_400 + int(hh) * 3_600 + int(mm) * 60 + int(whole)
    return seconds * 10_000_000 + int((frac + "0000000")[:7])


def _source_name(path: Path, default: str) -> str:
    name = path.name.lower()
    if "code" in name:
        return "azure-code"
    if "conv" in name:
        return "azure-conv"
    return default


def read_azure(
    path: str | os.PathLike[str], *, limit: int | None = None, tier: str = "interactive"
) -> list[TraceRequest]:
    """Read an Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`, CRLF line ends).

    Arrivals are made relative to the first row. `limit` keeps only the first `limit` rows.
    """
    p = Path(path)
    source = _source_name(p, "azure")
    rows: list[tuple[int, int, int]] = []
    # newline="" lets the csv module own line endings, so CRLF (and a missing final newline) parse cleanly.
    with p.open("r", newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader)
        expected = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if [h.strip() for h in header] != expected:
            raise ValueError(f"{p}: expected header {expected}, got {header}")
        for row in reader:
            if not row:
                continue
            if limit is not None and len(rows) >= limit:
                break
            rows.append((_azure_ticks(row[0]), int(row[1]), int(row[2])))
    if not rows:
        return []
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [
        TraceRequest(
            arrival_ms=(t - t0) / 10_000.0,  # ticks of 100 ns -> ms
            prompt_tokens=max(1, prompt),
            output_tokens=max(1, output),
            tier=tier,
            source=source,
        )
        for t, prompt, output in rows
    ]


def read_mooncake(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    bucket_spread_ms: float = 0.0,
    tier: str = "interactive",
) -> list[TraceRequest]:
    """Read a Mooncake FAST'25 JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

    The conversation trace's timestamps come in ~3 s buckets. With `bucket_spread_ms == 0` (default) every
    request of a bucket fires at the bucket's timestamp, as recorded. With `bucket_spread_ms > 0` the k-th of
    n requests sharing a timestamp arrives at `timestamp + k * bucket_spread_ms / n` (evenly spread, no
    randomness, order kept), e.g. 3000 to spread each bucket over its 3 s.
    """
    p = Path(path)
    raw: list[tuple[float, int, int, tuple[int, ...]]] = []
    with p.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if limit is not None and len(raw) >= limit:
                break
            try:
                obj = json.loads(line)
                raw.append(
                    (
                        float(obj["timestamp"]),
                        int(obj["input_length"]),
                        int(obj["output_length"]),
                        tuple(int(h) for h in obj.get("hash_ids", ())),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{p}:{line_no}: bad Mooncake record: {exc}") from exc
    if not raw:
        return []
    raw.sort(key=lambda r: r[0])  # stable: keeps file order within a bucket
    t0 = raw[0][0]
    out: list[TraceRequest] = []
    i = 0
    while i < len(raw):
        j = i
        while j < len(raw) and raw[j][0] == raw[i][0]:
            j += 1
        n = j - i
        for k in range(i, j):
            t, prompt, output, hashes = raw[k]
            offset = (k - i) * bucket_spread_ms / n if bucket_spread_ms > 0 else 0.0
            out.append(
                TraceRequest(
                    arrival_ms=t - t0 + offset,
                    prompt_tokens=max(1, prompt),
                    output_tokens=max(1, output),
                    tier=tier,
                    prefix_hash_ids=hashes,
                    source="mooncake-conv",
                )
            )
        i = j
    return out
