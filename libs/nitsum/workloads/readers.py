"""Readers for per-request traces: Azure LLM inference 2023 and 2024 (CSV), BurstGPT (CSV) and Mooncake FAST'25
(JSONL).

Each returns requests sorted by arrival, with the first arrival at 0 ms. A row that cannot be read is refused
with the file, its line and its column named; `read_csv_trace` tells the two CSV formats apart by their header.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

from nitsum.workloads.request import TraceRequest

MOONCAKE_BLOCK_TOKENS = 512  # tokens per Mooncake hash_id block (SOURCE.md: len(hash_ids) == ceil(input/512))

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# BurstGPT (github.com/HPMLL/BurstGPT): `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`;
# its later files add `Session ID` and `Elapsed time`. These are the columns read; the others may be there or not.
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
BURSTGPT_STAMP_MS = 1000.0  # BurstGPT's timestamps are seconds (whole seconds in its published files)

# Azure 2023: `2023-11-16 18:17:03.9799600` (naive, 7 fractional digits). Azure 2024:
# `2024-05-10 00:00:00.009930+00:00` (UTC offset, 6 digits; some rows carry no fraction). `T` and `Z` accepted too.
_AZURE_STAMP = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(?:\s*(Z|[+-]\d{2}:?\d{2}))?"
)


def _azure_ticks(stamp: str) -> int:
    """100-ns ticks since 0001-01-01 UTC of an Azure trace stamp (see `_AZURE_STAMP`; a naive one is taken as is).

    Integer arithmetic because a float of seconds since year 1 keeps only ~10 us, and the trace's 100-ns
    digit must survive; datetime.fromisoformat on 3.11 does not take 7 fractional digits either. Digits past
    the seventh are dropped. Raises ValueError for anything else.
    """
    m = _AZURE_STAMP.fullmatch(stamp.strip())
    if m is None:
        raise ValueError(
            f"{stamp!r} is not a timestamp like 2023-11-16 18:17:03.9799600 or 2024-05-10 00:00:00.009930+00:00"
        )
    date_part, hh, mm, ss, frac, zone = m.groups()
    days = _dt.date.fromisoformat(date_part).toordinal()
    if int(hh) > 23 or int(mm) > 59 or int(ss) > 60:
        raise ValueError(f"{stamp!r} has no such time of day")
    seconds = days * 86_400 + int(hh) * 3_600 + int(mm) * 60 + int(ss)
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        seconds -= sign * (int(digits[:2]) * 3_600 + int(digits[2:]) * 60)  # local = UTC + offset
    return seconds * 10_000_000 + int(((frac or "") + "0000000")[:7])


def _tokens(value: str, where: str, column: str) -> int:
    """A token count >= 0; a whole number written `374.0` is taken."""
    try:
        n = int(value.strip())
    except ValueError:
        try:  # some exports write counts as `374.0`
            f = float(value)
        except ValueError:
            raise ValueError(f"{where}: column {column}: {value!r} is not a token count") from None
        if not f.is_integer():
            raise ValueError(f"{where}: column {column}: {value!r} is not a whole number of tokens") from None
        n = int(f)
    if n < 0:
        raise ValueError(f"{where}: column {column}: {value!r} must be >= 0")
    return n


def _source_name(path: Path, default: str) -> str:
    name = path.name.lower()
    if "code" in name:
        return "azure-code"
    if "conv" in name:
        return "azure-conv"
    return default


def _csv_header(path: Path) -> list[str]:
    with path.open("r", newline="", encoding="utf-8-sig") as f:
        return [h.strip() for h in next(csv.reader(f), [])]


def read_azure(
    path: str | os.PathLike[str], *, limit: int | None = None, tier: str = "interactive"
) -> list[TraceRequest]:
    """Read an Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): the 2023 traces (naive
    stamps, 7 fractional digits, CRLF line ends) and the 2024 week-long ones (stamps with a UTC offset).

    Arrivals are made relative to the first row. `limit` keeps only the first `limit` rows.
    """
    p = Path(path)
    source = _source_name(p, "azure")
    rows: list[tuple[int, int, int]] = []
    # newline="" lets the csv module own line endings, so CRLF (and a missing final newline) parse cleanly.
    with p.open("r", newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        if tuple(h.strip() for h in header) != AZURE_HEADER:
            hint = " (this is a BurstGPT header: read it with read_burstgpt)" if _is_burstgpt(header) else ""
            raise ValueError(f"{p}: expected header {list(AZURE_HEADER)}, got {header}{hint}")
        for row in reader:
            if not row or not any(c.strip() for c in row):
                continue
            if limit is not None and len(rows) >= limit:
                break
            where = f"{p}:{reader.line_num}"
            if len(row) != len(AZURE_HEADER):
                raise ValueError(f"{where}: expected {len(AZURE_HEADER)} columns, got {len(row)}: {row}")
            try:
                ticks = _azure_ticks(row[0])
            except ValueError as exc:
                raise ValueError(f"{where}: column TIMESTAMP: {exc}") from None
            rows.append((ticks, _tokens(row[1], where, "ContextTokens"), _tokens(row[2], where, "GeneratedTokens")))
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


def _is_burstgpt(header: Sequence[str]) -> bool:
    names = {h.strip() for h in header}
    return all(c in names for c in BURSTGPT_COLUMNS)


def read_burstgpt(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    models: Sequence[str] | None = None,
    bucket_spread_ms: float = 0.0,
    tier: str = "interactive",
) -> list[TraceRequest]:
    """Read a BurstGPT CSV (`Timestamp` in seconds, `Request tokens`, `Response tokens`; `Model` and the rest
    optional), as vLLM's and SGLang's benchmarks replay it.

    Rows with 0 response tokens are the trace's failed requests and are left out, as those benchmarks do.
    `models` keeps only rows whose `Model` is one of them (e.g. `["GPT-4"]`). `limit` keeps the first `limit`
    rows read. The stamps are whole seconds, so many requests share one: with `bucket_spread_ms > 0` the k-th
    of n requests of a stamp arrives `k * spread / n` after it, the spread being at most `bucket_spread_ms`,
    one second and the gap to the next stamp (buckets keep their order). 0 fires each bucket at once.
    """
    p = Path(path)
    wanted = None if models is None else {m.strip() for m in models}
    raw: list[tuple[float, int, int]] = []
    with p.open("r", newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        fields = [h.strip() for h in (reader.fieldnames or [])]
        reader.fieldnames = fields
        if not _is_burstgpt(fields):
            hint = " (this is an Azure header: read it with read_azure)" if tuple(fields) == AZURE_HEADER else ""
            raise ValueError(f"{p}: a BurstGPT trace needs the columns {list(BURSTGPT_COLUMNS)}, got {fields}{hint}")
        if wanted is not None and "Model" not in fields:
            raise ValueError(f"{p}: no Model column to filter on (models={sorted(wanted)})")
        for row in reader:
            if limit is not None and len(raw) >= limit:
                break
            where = f"{p}:{reader.line_num}"
            if None in row or any(row.get(c) is None for c in BURSTGPT_COLUMNS):
                raise ValueError(f"{where}: expected {len(fields)} columns: {list(row.values())}")
            if wanted is not None and row["Model"].strip() not in wanted:
                continue
            try:
                stamp = float(row["Timestamp"])
            except ValueError:
                raise ValueError(
                    f"{where}: column Timestamp: {row['Timestamp']!r} is not a number of seconds"
                ) from None
            if not (math.isfinite(stamp) and stamp >= 0):
                raise ValueError(f"{where}: column Timestamp: {row['Timestamp']!r} must be a finite time >= 0")
            prompt = _tokens(row["Request tokens"], where, "Request tokens")
            output = _tokens(row["Response tokens"], where, "Response tokens")
            if output == 0:
                continue  # a failed request in the source
            raw.append((stamp * 1000.0, prompt, output))
    if not raw:
        return []
    raw.sort(key=lambda r: r[0])  # stable: keeps file order within a stamp
    t0 = raw[0][0]
    stamps = [t for t, _, _ in raw]
    offsets = _bucket_offsets(stamps, lambda gap: min(bucket_spread_ms, BURSTGPT_STAMP_MS, gap))
    return [
        TraceRequest(
            arrival_ms=t - t0 + off,
            prompt_tokens=max(1, prompt),
            output_tokens=output,
            tier=tier,
            source="burstgpt",
        )
        for (t, prompt, output), off in zip(raw, offsets)
    ]


def read_csv_trace(
    path: str | os.PathLike[str], *, limit: int | None = None, bucket_spread_ms: float = 0.0
) -> list[TraceRequest]:
    """An Azure (2023 or 2024) or BurstGPT CSV, told apart by its header; anything else is refused naming both."""
    p = Path(path)
    header = _csv_header(p)
    if tuple(header) == AZURE_HEADER:
        return read_azure(p, limit=limit)
    if _is_burstgpt(header):
        return read_burstgpt(p, limit=limit, bucket_spread_ms=bucket_spread_ms)
    raise ValueError(
        f"{p}: header {header} is neither an Azure LLM inference trace ({','.join(AZURE_HEADER)}) nor a BurstGPT "
        f"one (columns {', '.join(BURSTGPT_COLUMNS)})"
    )


def _bucket_offsets(stamps: Sequence[float], spread_for_gap) -> list[float]:
    """Per sorted stamp, its offset when each run of equal stamps (a bucket) of n is spread evenly over
    `spread_for_gap(gap to the next bucket, inf for the last)` ms: the k-th gets k * spread / n."""
    out: list[float] = []
    i = 0
    while i < len(stamps):
        j = i
        while j < len(stamps) and stamps[j] == stamps[i]:
            j += 1
        gap = stamps[j] - stamps[i] if j < len(stamps) else float("inf")
        spread = max(0.0, spread_for_gap(gap))
        n = j - i
        out.extend((k * spread / n) if spread > 0 else 0.0 for k in range(n))
        i = j
    return out


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
    offsets = _bucket_offsets([r[0] for r in raw], lambda _gap: bucket_spread_ms)
    return [
        TraceRequest(
            arrival_ms=t - t0 + off,
            prompt_tokens=max(1, prompt),
            output_tokens=max(1, output),
            tier=tier,
            prefix_hash_ids=hashes,
            source="mooncake-conv",
        )
        for (t, prompt, output, hashes), off in zip(raw, offsets)
    ]
