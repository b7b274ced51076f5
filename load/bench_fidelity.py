"""`nitsum bench fidelity`: the simulator against the live mesh on the same slice of a real trace.

The first `--requests` rows of the Azure conversation trace, rescaled to `--rate` requests/s (the trace's
burstiness kept) and capped to `--max-prompt-tokens` / `--max-output-tokens` so the CPU mesh sustains them,
are
- sent to a live `nitsum up --devices 1 --policy P` by the load generator (token-id prompts on
  /v1/completions, so the prompt lengths are exact; ignore_eos, so the output lengths are exact), and
- replayed by the cluster simulator (`nitsum.sim.cluster`) with the same policy, one device, the worker's
  batch limits and the CPU device table (nitsum/data/costmodel/cpu.json, which `nitsum bench profile`
  writes).
Both are summarized by `nitsum.metrics`; the bench prints TTFT and TPOT p50/p90 side by side with the
simulator's relative error. The goal is |error| <= 15%.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from nitsum.metrics import Report, summarize
from nitsum.workloads import TraceRequest, scale_to_rate
from nitsum_load.client import ClientConfig
from nitsum_load.mesh import start_mesh
from nitsum_load.report import write_all
from nitsum_load.runner import run_open_loop
from nitsum_load.workload import Shaping, read_trace, shape

GOAL_REL_ERROR = 0.15
# The worker's defaults (nitsum.config.WorkerConfig): the simulator must batch like the engine does.
WORKER_MAX_NUM_SEQS = 64
WORKER_MAX_BATCHED_TOKENS = 512
WORKER_BLOCK_SIZE = 16
METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"))


def build_workload(trace: str, n: int, rate_per_s: float, max_prompt: int, max_output: int) -> list[TraceRequest]:
    reqs = scale_to_rate(read_trace(trace, limit=n), rate_per_s)
    t0 = reqs[0].arrival_ms
    return [dataclasses.replace(r, arrival_ms=r.arrival_ms - t0, prompt_tokens=min(r.prompt_tokens, max_prompt),
                                output_tokens=min(r.output_tokens, max_output)) for r in reqs]


def simulate(workload: list[TraceRequest], policy: str) -> Any:
    """The simulator on the CPU device table that ships in nitsum/data/costmodel/cpu.json (what
    `nitsum bench profile` writes), one device, the worker's batch limits."""
    from nitsum.policy.costmodel import load_device_table
    from nitsum.sim.cluster import ClusterConfig, ClusterSim

    config = ClusterConfig(model="tiny", device_kind="cpu", num_nodes=1, devices_per_node=1, min_tp=1, max_tp=1,
                           chunk_tokens=WORKER_MAX_BATCHED_TOKENS, max_batch=WORKER_MAX_NUM_SEQS,
                           block_size_tokens=WORKER_BLOCK_SIZE, drain_ms=120_000.0)
    return ClusterSim(policy, config, workload).run(), load_device_table(None)


async def live(url: str, model: str, workload: list[TraceRequest]) -> list:
    specs = shape(workload, Shaping())
    cfg = ClientConfig(base_url=url, model=model, endpoint="completions", prompt_format="token-ids",
                       return_token_ids=True, ignore_eos=True, request_timeout_s=120.0)
    result = await run_open_loop(specs, cfg, drain_timeout_s=120.0)
    return result.trackers


def side_by_side(live_report: Report, sim_report: Report) -> list[dict[str, Any]]:
    rows = []
    for dist, stat in METRICS:
        a = getattr(getattr(live_report.overall, dist), stat)
        b = getattr(getattr(sim_report.overall, dist), stat)
        err = None if a is None or b is None or a == 0 else (b - a) / a
        rows.append({"metric": f"{dist.split('_')[0].upper()} {stat} (ms)", "live": a, "sim": b, "rel_error": err})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'metric':<16}{'live mesh':>12}{'simulator':>12}{'sim error':>12}"]
    for r in rows:
        live_s = "-" if r["live"] is None else f"{r['live']:.2f}"
        sim_s = "-" if r["sim"] is None else f"{r['sim']:.2f}"
        err_s = "-" if r["rel_error"] is None else f"{r['rel_error'] * 100:+.1f}%"
        lines.append(f"{r['metric']:<16}{live_s:>12}{sim_s:>12}{err_s:>12}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nitsum bench fidelity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrival rate after rescaling (requests/s)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--policy", default="static-tp:1", help="policy of both the mesh and the simulator")
    p.add_argument("--url", default=None, help="measure this running one-worker mesh instead of starting one")
    p.add_argument("--out", type=Path, default=None, help="write live/ and sim/ reports and fidelity.json here")
    args = p.parse_args(argv)
    if args.requests < 2 or not args.rate > 0 or args.max_prompt_tokens < 1 or args.max_output_tokens < 1:
        p.error("need --requests >= 2, --rate > 0 and positive token caps")
    workload = build_workload(args.trace, args.requests, args.rate, args.max_prompt_tokens, args.max_output_tokens)

    sim_result, table = simulate(workload, args.policy)
    if table.placeholder:
        print("warning: the CPU device table holds placeholder figures; run `nitsum bench profile` first", flush=True)

    mesh = None
    url = args.url
    if url is None:
        run_dir = Path(tempfile.mkdtemp(prefix="nitsum-bench-fidelity-"))
        print(f"starting nitsum up --devices 1 --policy {args.policy} (logs in {run_dir}) ...", flush=True)
        mesh = start_mesh(run_dir, devices=1, extra_args=("--policy", args.policy))
        url = mesh.url
    try:
        print(f"live: {len(workload)} requests at {args.rate} req/s against {url} ...", flush=True)
        trackers = asyncio.run(live(url, "tiny", workload))
    finally:
        if mesh is not None:
            mesh.stop()
    live_records = [t.to_record() for t in trackers]
    live_report = summarize(live_records)
    rows = side_by_side(live_report, sim_result.report)
    print(format_rows(rows))
    errs = [abs(r["rel_error"]) for r in rows if r["rel_error"] is not None]
    worst = max(errs) if errs else None
    verdict = "-" if worst is None else ("within" if worst <= GOAL_REL_ERROR else "outside")
    print(f"live: {live_report.overall.succeeded}/{live_report.overall.requests} succeeded; "
          f"worst error {'-' if worst is None else f'{worst * 100:.1f}%'} ({verdict} the {GOAL_REL_ERROR:.0%} goal)")
    if args.out:
        meta = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "date": time.strftime("%Y-%m-%d"), "machine": {"platform": platform.platform(),
                                                              "cpus": os.cpu_count()},
                "device_table": dataclasses.asdict(table) if dataclasses.is_dataclass(table) else str(table)}
        write_all(live_report, live_records, args.out / "live", meta, log_rows=(t.to_log() for t in trackers))
        write_all(sim_result.report, sim_result.records, args.out / "sim", meta)
        (args.out / "fidelity.json").write_text(json.dumps({**meta, "rows": rows, "worst_rel_error": worst},
                                                           indent=2, default=str) + "\n")
    return 0
