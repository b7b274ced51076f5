"""`nitsum bench fidelity`'s live side: the slice sent to a fresh one-worker mesh (after a warm-up), or a
session of a run saved with --out read back for --replay."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from nitsum.metrics import RequestRecord
from nitsum.workloads import TraceRequest
from nitsum_load.client import ClientConfig, RequestSpec
from nitsum_load.fidelity_diagnostics import read_spans
from nitsum_load.fidelity_sim import Session, interleave
from nitsum_load.mesh import start_mesh
from nitsum_load.report import read_lifecycle_log
from nitsum_load.runner import run_open_loop
from nitsum_load.workload import Shaping, shape

# Warm-up before the slice (dropped): the mesh's first requests pay one-off costs (connections, lazy imports,
# allocator growth). 8 prompt + 8 output tokens never fill a 16-token KV block: nothing lands in the prefix cache.
WARMUP_REQUESTS, WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS, WARMUP_GAP_MS = 6, 8, 8, 100.0


def client_config(url: str, model: str) -> ClientConfig:
    return ClientConfig(
        base_url=url,
        model=model,
        endpoint="completions",
        prompt_format="token-ids",
        return_token_ids=True,
        ignore_eos=True,
        request_timeout_s=120.0,
    )


async def live(url: str, model: str, workload: list[TraceRequest]) -> tuple[list, float]:
    """The slice's trackers, and the wall clock (unix ms) of the load generator's time 0 (to place its times
    next to the services' spans)."""
    cfg = client_config(url, model)
    warm = [
        RequestSpec(
            request_id=f"warmup-{i}",
            arrival_ms=i * WARMUP_GAP_MS,
            prompt_tokens=WARMUP_PROMPT_TOKENS,
            output_tokens=WARMUP_OUTPUT_TOKENS,
            tier="interactive",
            ttft_slo_ms=1000.0,
            tpot_slo_ms=100.0,
            weight=1.0,
        )
        for i in range(WARMUP_REQUESTS)
    ]
    await run_open_loop(warm, cfg, drain_timeout_s=30.0)
    wall0_ms = time.time() * 1000.0  # run_open_loop takes its time 0 right after this (microseconds later)
    result = await run_open_loop(shape(workload, Shaping()), cfg, drain_timeout_s=120.0)
    return result.trackers, wall0_ms


def run_live(
    args: argparse.Namespace, workload: list[TraceRequest]
) -> tuple[list[RequestRecord], list[dict], list[dict], float]:
    """The slice on a live mesh (started here unless --url): its records and lifecycle-log rows in row order, the
    mesh's spans (none for --url) and the load generator's time 0 (unix ms)."""
    mesh = None
    run_dir = None
    url = args.url
    if url is None:
        run_dir = Path(tempfile.mkdtemp(prefix="nitsum-bench-fidelity-"))
        affinity = getattr(args, "cpu_affinity", "auto")
        print(
            f"starting nitsum up --devices 1 --policy {args.policy} --cpu-affinity {affinity} (logs in {run_dir}) ...",
            flush=True,
        )
        mesh = start_mesh(run_dir, devices=1, extra_args=("--policy", args.policy, "--cpu-affinity", affinity))
        url = mesh.url
    try:
        print(
            f"live: {len(workload)} requests ({args.requests} evaluation + {len(workload) - args.requests} "
            f"calibration, interleaved) against {url} ...",
            flush=True,
        )
        trackers, wall0_ms = asyncio.run(live(url, "tiny", workload))
    finally:
        if mesh is not None:
            mesh.stop()  # the services flush their spans as they stop
    if len(trackers) != len(workload):
        raise RuntimeError(f"the load generator sent {len(trackers)} of {len(workload)} requests")
    spans_path = None if run_dir is None else run_dir / "run" / "spans.jsonl"
    spans = read_spans(spans_path) if spans_path is not None and spans_path.is_file() else []
    return [t.to_record() for t in trackers], [t.to_log() for t in trackers], spans, wall0_ms


def replayed(run: Path, k: int, workload: list[TraceRequest], wall0_ms: float) -> Session:
    """Session k of a run saved with --out: its live records and log rows (row order) and spans."""
    d = run / f"session-{k}"
    records = interleave(
        read_lifecycle_log(d / "live" / "requests.jsonl"), read_lifecycle_log(d / "live-calibration" / "requests.jsonl")
    )
    logs = interleave(
        *[
            [json.loads(line) for line in (d / name / "requests.jsonl").read_text().splitlines() if line.strip()]
            for name in ("live", "live-calibration")
        ]
    )
    spans = read_spans(d / "spans.jsonl") if (d / "spans.jsonl").is_file() else []
    return Session(k, workload, records, logs, spans, wall0_ms)
