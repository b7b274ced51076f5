"""ServeGen window statistics sampled into per-request arrivals.

ServeGen (Alibaba Bailian) publishes no per-request trace: for each client and 600-s window it gives the mean
rate, the CV and a fitted inter-arrival distribution (Gamma or Weibull with shape, scale), and every 6 h the
PMFs of input and output lengths. We sample like ServeGen describes: draw gaps from the fitted distribution,
rescale them so their mean matches the window's rate, and draw lengths from the client's PMF of that 6-h
window. Clients without a dataset.json (55 files were too large to copy) take lengths from the pooled PMF of
the clients that have one in the same 6-h window.

`archive` is a `servegen_<model>.tar.gz` as shipped in shared/traces, or a directory holding
`chunk-<client>-trace.csv` / `chunk-<client>-dataset.json` files (at any depth).
"""

from __future__ import annotations

import ast
import json
import math
import os
import random
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

from nitsum.workloads.request import TraceRequest

WINDOW_S = 600.0  # one row of chunk-N-trace.csv
LENGTH_WINDOW_S = 21_600.0  # one key of chunk-N-dataset.json
_MEMBER_RE = re.compile(r"(?:^|/)chunk-(\d+)-(trace\.csv|dataset\.json)$")

# (values, cumulative weights) for random.choices
Pmf = tuple[list[int], list[float]]


def _read_members(archive: Path, wanted: set[int] | None) -> tuple[dict[int, str], dict[int, str], str]:
    """Texts of trace.csv and dataset.json per client, and the model name."""
    traces: dict[int, str] = {}
    datasets: dict[int, str] = {}
    model = archive.name.removeprefix("servegen_").removesuffix(".tar.gz")

    def take(name: str, data: bytes) -> None:
        m = _MEMBER_RE.search(name)
        if not m:
            return
        client = int(m.group(1))
        if wanted is not None and client not in wanted:
            return
        text = data.decode("utf-8")
        (traces if m.group(2) == "trace.csv" else datasets)[client] = text

    if archive.is_dir():
        for p in sorted(archive.rglob("chunk-*")):
            if p.is_file():
                take(p.as_posix(), p.read_bytes())
    else:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.isfile() and _MEMBER_RE.search(member.name):
                    m = _MEMBER_RE.search(member.name)
                    # Skip unwanted clients without reading their bytes.
                    if wanted is not None and int(m.group(1)) not in wanted:
                        continue
                    f = tar.extractfile(member)
                    assert f is not None, f"tar member {member.name} has no data"
                    take(member.name, f.read())
    return traces, datasets, model


def _parse_trace(text: str) -> list[tuple[float, float, str, float, float]]:
    """Rows (window_start_s, rate_per_s, dist, shape, scale); inactive windows have dist == ''."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split(",")
        if len(parts) < 3 or not parts[0]:
            continue
        start, rate = float(parts[0]), float(parts[1])
        dist = parts[3].strip() if len(parts) > 3 else ""
        shape = float(parts[4]) if len(parts) > 4 and parts[4] else 0.0
        scale = float(parts[5]) if len(parts) > 5 and parts[5] else 0.0
        rows.append((start, rate, dist, shape, scale))
    return rows


def _parse_pmf(literal: str) -> Pmf | None:
    # The files hold Python dict literals ({224: 0.0003, ...}), not JSON: literal_eval is the safe parser.
    d = ast.literal_eval(literal)
    if not d:
        return None
    values = sorted(int(k) for k in d)
    cum, acc = [], 0.0
    for v in values:
        acc += float(d[v])
        cum.append(acc)
    return values, cum


def _parse_dataset(text: str) -> dict[float, dict[str, Pmf]]:
    raw = json.loads(text)
    out: dict[float, dict[str, Pmf]] = {}
    for key, fields in raw.items():
        parsed: dict[str, Pmf] = {}
        for field, literal in fields.items():
            pmf = _parse_pmf(literal)
            if pmf is not None:
                parsed[field] = pmf
        out[float(key)] = parsed
    return out


def _dist_mean(dist: str, shape: float, scale: float) -> float:
    if dist == "Gamma":
        return shape * scale
    if dist == "Weibull":
        return scale * math.gamma(1.0 + 1.0 / shape)
    raise ValueError(f"unknown ServeGen inter-arrival distribution {dist!r}")


def _merge(pmfs: list[Pmf]) -> Pmf | None:
    """Equal-weight mixture of PMFs (the pooled fallback)."""
    if not pmfs:
        return None
    weights: dict[int, float] = {}
    for values, cum in pmfs:
        prev = 0.0
        for v, c in zip(values, cum):
            weights[v] = weights.get(v, 0.0) + (c - prev) / cum[-1]
            prev = c
    values = sorted(weights)
    acc, cum = 0.0, []
    for v in values:
        acc += weights[v]
        cum.append(acc)
    return values, cum


def _prompt_fields(fields: dict[str, Pmf]) -> list[str]:
    # Language and reasoning models: input_tokens. mm-image: text + image tokens (both occupy the prompt).
    if "input_tokens" in fields:
        return ["input_tokens"]
    return [f for f in ("text_tokens", "image_tokens", "audio_tokens", "video_tokens") if f in fields]


def servegen_arrivals(
    archive: str | os.PathLike[str],
    *,
    start_s: float = 0.0,
    duration_s: float = 600.0,
    seed: int = 0,
    clients: Iterable[int] | None = None,
    rate_scale: float = 1.0,
    tier: str = "interactive",
) -> list[TraceRequest]:
    """Sample requests for [start_s, start_s + duration_s) of a ServeGen model; arrivals relative to start_s.

    `clients` restricts to some client ids (default: all). `rate_scale` multiplies every window's rate (the
    published absolute rates may be normalized; see SOURCE.md). Sorted by arrival; deterministic for `seed`.
    """
    if not duration_s > 0 or not rate_scale > 0:
        raise ValueError("duration_s and rate_scale must be > 0")
    path = Path(archive)
    wanted = None if clients is None else set(clients)
    trace_texts, dataset_texts, model = _read_members(path, wanted)
    if not trace_texts:
        raise ValueError(f"{path}: no chunk-*-trace.csv for clients {sorted(wanted) if wanted else 'any'}")
    datasets = {c: _parse_dataset(t) for c, t in sorted(dataset_texts.items())}
    end_s = start_s + duration_s

    pooled_cache: dict[tuple[float, str], Pmf | None] = {}

    def pmf_for(client: int, t_s: float, field: str) -> Pmf | None:
        key = math.floor(t_s / LENGTH_WINDOW_S) * LENGTH_WINDOW_S
        ds = datasets.get(client)
        if ds is not None:
            got = ds.get(key, {}).get(field)
            if got is not None:
                return got
        if (key, field) not in pooled_cache:
            pooled_cache[(key, field)] = _merge([d[key][field] for d in datasets.values() if field in d.get(key, {})])
            if pooled_cache[(key, field)] is None:  # nothing in this 6-h window: pool over all windows
                pooled_cache[(key, field)] = _merge(
                    [p[field] for d in datasets.values() for p in d.values() if field in p]
                )
        return pooled_cache[(key, field)]

    prompt_fields: list[str] = ["input_tokens"]
    for ds in datasets.values():
        for fields in ds.values():
            if fields:
                prompt_fields = _prompt_fields(fields)
                break
        else:
            continue
        break

    out: list[tuple[float, int, int, int]] = []
    for client in sorted(trace_texts):
        # One generator per client, seeded from (seed, client): adding a client does not move the others.
        rng = random.Random(f"{seed}:{client}")
        # The renewal process runs on across windows (each gap drawn with the parameters of the window it
        # starts in). After an inactive stretch it restarts with an equilibrium first gap: a fresh start at a
        # window edge would add about (CV^2 - 1)/2 arrivals per restart, hundreds for ServeGen's CV ~ 30 clients.
        t = -math.inf
        for w_start, rate, dist, shape, scale in _parse_trace(trace_texts[client]):
            w_end = w_start + WINDOW_S
            active = rate > 0 and dist in ("Gamma", "Weibull") and shape > 0 and scale > 0
            if w_end <= start_s - WINDOW_S or w_start >= end_s or not active:
                t = -math.inf  # inactive (or skipped) window: the next active one restarts the process
                continue
            factor = 1.0 / (rate * rate_scale * _dist_mean(dist, shape, scale))  # rescale gaps to the rate

            def gap(dist: str = dist, shape: float = shape, scale: float = scale, factor: float = factor) -> float:
                g = rng.gammavariate(shape, scale) if dist == "Gamma" else rng.weibullvariate(scale, shape)
                return g * factor

            if t == -math.inf:
                # Equilibrium residual gap: a length-biased gap (chosen among 32 with weight = length) times U(0,1).
                pool = [gap() for _ in range(32)]
                t = w_start + rng.choices(pool, weights=pool)[0] * rng.random()
            while t < w_end:
                if start_s <= t < end_s:
                    prompt = 0
                    for field in prompt_fields:
                        pmf = pmf_for(client, t, field)
                        if pmf is not None:
                            prompt += rng.choices(pmf[0], cum_weights=pmf[1])[0]
                    out_pmf = pmf_for(client, t, "output_tokens")
                    output = rng.choices(out_pmf[0], cum_weights=out_pmf[1])[0] if out_pmf else 1
                    out.append((t, client, max(1, prompt), max(1, output)))
                t += gap()
    out.sort()
    return [
        TraceRequest(
            arrival_ms=(t - start_s) * 1000.0,
            prompt_tokens=p,
            output_tokens=o,
            tier=tier,
            source=f"servegen-{model}:{client}",
        )
        for t, client, p, o in out
    ]


def servegen_clients(archive: str | os.PathLike[str]) -> list[int]:
    """Client ids present in an archive (those with a trace.csv)."""
    traces, _, _ = _read_members(Path(archive), None)
    return sorted(traces)


__all__ = ["servegen_arrivals", "servegen_clients", "WINDOW_S", "LENGTH_WINDOW_S"]
