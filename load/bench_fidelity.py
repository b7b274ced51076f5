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

The device table times engine steps only. The live mesh adds two costs the simulator does not model: the request
path (HTTP, gateway, NATS, coordinator routing, the first token's way back) and a per-step service cost (the
worker publishing each step's tokens on NATS, the gateway writing SSE, detokenising, event-loop turns). Before the
slice, the bench measures both on the live mesh with separate calibration requests, one at a time: 1-token
requests (path = TTFT - the table's prefill step) and long single decodes (service step = TPOT - the table's
decode step at batch 1). It then also runs the simulator on the table plus those two figures (step overhead +
service step; every time shifted by the path) and prints both comparisons. Nothing is fitted to the slice.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nitsum.metrics import Report, RequestRecord, summarize
from nitsum.policy.costmodel import CostModel, DeviceSpec, cost_model, load_device_table
from nitsum.workloads import TraceRequest, scale_to_rate
from nitsum_load.client import ClientConfig, RequestSpec
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


def _table_sim(policy: str, config: Any, workload: list[TraceRequest], table: DeviceSpec) -> Any:
    """A ClusterSim stepping on `table`. ClusterConfig.device_kind only names presets (and "cpu" is the shipped
    table, cached), so the table is given to the policy through PolicyConfig.devices and to the groups by
    overriding the cost model the simulator builds. Proposed instead (owner of nitsum.sim.cluster): a
    `ClusterConfig.device_table: DeviceSpec | None` used by `ClusterSim.__init__` and `policy_config()`."""
    from nitsum.policy.registry import make_policy
    from nitsum.sim.cluster import ClusterSim

    class TableSim(ClusterSim):
        @property
        def cost(self) -> CostModel:
            return self._table_cost

        @cost.setter
        def cost(self, _preset: CostModel) -> None:
            pass  # ClusterSim.__init__ assigns the preset's model; the given table's wins

    pc = dataclasses.replace(config.policy_config(), devices=((config.device_kind, table),))
    sim = TableSim.__new__(TableSim)
    sim._table_cost = cost_model(config.model, table)
    TableSim.__init__(sim, make_policy(policy, pc), config, workload)
    return sim


def simulate(workload: list[TraceRequest], policy: str, table: DeviceSpec | None = None) -> Any:
    """The simulator on a CPU device table (default: the one that ships in nitsum/data/costmodel/cpu.json, what
    `nitsum bench profile` writes), one device, the worker's batch limits. Returns (result, table)."""
    from nitsum.sim.cluster import ClusterConfig

    table = table or load_device_table(None)
    config = ClusterConfig(model="tiny", device_kind="cpu", num_nodes=1, devices_per_node=1, min_tp=1, max_tp=1,
                           chunk_tokens=WORKER_MAX_BATCHED_TOKENS, max_batch=WORKER_MAX_NUM_SEQS,
                           block_size_tokens=WORKER_BLOCK_SIZE, drain_ms=120_000.0)
    return _table_sim(policy, config, workload, table).run(), table


# Calibration requests (token-id prompts, one at a time): the request path from 1-token requests, the service's
# per-step cost from long decodes at batch 1.
PATH_PROBES, PATH_PROMPT_TOKENS, PATH_GAP_MS = 20, 8, 150.0
STEP_PROBES, STEP_PROMPT_TOKENS, STEP_OUTPUT_TOKENS, STEP_GAP_MS = 5, 8, 129, 800.0


@dataclass(frozen=True)
class ServiceOverheads:
    """What the live mesh adds to the table's engine steps, measured on calibration requests."""

    path_ms: float  # added to every request's times (TTFT of a 1-token request - the table's prefill step)
    step_ms: float  # added to every engine step (batch-1 TPOT - the table's decode step)
    live_path_ttft_ms: float
    live_step_tpot_ms: float


def overheads_from(table: DeviceSpec, path_ttft_ms: float, step_tpot_ms: float) -> ServiceOverheads:
    """Subtract what the table already predicts for the calibration requests (tiny model, TP=1)."""
    cm = cost_model("tiny", table)
    prefill_ms = cm.step_time_ms(1, 1, PATH_PROMPT_TOKENS, PATH_PROMPT_TOKENS)
    mean_ctx = STEP_PROMPT_TOKENS + STEP_OUTPUT_TOKENS // 2
    decode_ms = cm.step_time_ms(1, 1, 1, mean_ctx)
    return ServiceOverheads(path_ms=path_ttft_ms - prefill_ms, step_ms=step_tpot_ms - decode_ms,
                            live_path_ttft_ms=path_ttft_ms, live_step_tpot_ms=step_tpot_ms)


def adjusted_table(table: DeviceSpec, ov: ServiceOverheads) -> DeviceSpec:
    """The table with the service's per-step cost added to its step overhead (never below the table's own)."""
    return dataclasses.replace(table, step_overhead_ms=table.step_overhead_ms + max(0.0, ov.step_ms),
                               source=f"{table.source} + measured service step {ov.step_ms:.3f} ms")


def shift_records(records: list[RequestRecord], delay_ms: float) -> list[RequestRecord]:
    """Every observed time of every request `delay_ms` later (the send time stays)."""
    def later(x: float | None) -> float | None:
        return None if x is None else x + delay_ms

    return [dataclasses.replace(r, first_token_ms=later(r.first_token_ms), finish_ms=later(r.finish_ms),
                                token_times_ms=tuple(t + delay_ms for t in r.token_times_ms)) for r in records]


def _probe_specs(n: int, prompt: int, output: int, gap_ms: float, tag: str) -> list[RequestSpec]:
    return [RequestSpec(request_id=f"{tag}-{i}", arrival_ms=i * gap_ms, prompt_tokens=prompt, output_tokens=output,
                        tier="interactive", ttft_slo_ms=1000.0, tpot_slo_ms=100.0, weight=1.0) for i in range(n)]


async def measure_overheads(url: str, model: str, table: DeviceSpec) -> ServiceOverheads:
    cfg = ClientConfig(base_url=url, model=model, endpoint="completions", prompt_format="token-ids",
                       return_token_ids=True, ignore_eos=True, request_timeout_s=60.0)
    # Distinct seeds would not matter: prefix caching is keyed on the prompt, and the probes' prompts (ids
    # 100..) are not in the slice; the first probe of each kind also warms the path up and is dropped.
    path = await run_open_loop(_probe_specs(PATH_PROBES + 1, PATH_PROMPT_TOKENS, 1, PATH_GAP_MS, "path"), cfg,
                               drain_timeout_s=30.0)
    step = await run_open_loop(_probe_specs(STEP_PROBES + 1, STEP_PROMPT_TOKENS, STEP_OUTPUT_TOKENS, STEP_GAP_MS,
                                            "step"), cfg, drain_timeout_s=60.0)
    path_report = summarize([t.to_record() for t in path.trackers[1:]]).overall
    step_report = summarize([t.to_record() for t in step.trackers[1:]]).overall
    if path_report.ttft_ms.p50 is None or step_report.tpot_ms.p50 is None:
        raise RuntimeError("calibration requests failed; see the mesh logs")
    return overheads_from(table, path_report.ttft_ms.p50, step_report.tpot_ms.p50)


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


def _verdict(rows: list[dict[str, Any]]) -> tuple[float | None, str]:
    errs = [abs(r["rel_error"]) for r in rows if r["rel_error"] is not None]
    worst = max(errs) if errs else None
    verdict = "-" if worst is None else ("within" if worst <= GOAL_REL_ERROR else "outside")
    return worst, f"worst error {'-' if worst is None else f'{worst * 100:.1f}%'} ({verdict} the {GOAL_REL_ERROR:.0%} goal)"


async def _live_phase(url: str, workload: list[TraceRequest], table: DeviceSpec, calibrate: bool,
                      ) -> tuple[list, ServiceOverheads | None]:
    ov = None
    if calibrate:
        print(f"calibrating service overheads ({PATH_PROBES} 1-token requests, {STEP_PROBES} decodes of "
              f"{STEP_OUTPUT_TOKENS} tokens, one at a time) ...", flush=True)
        ov = await measure_overheads(url, "tiny", table)
        print(f"  request path {ov.path_ms:.2f} ms (1-token TTFT {ov.live_path_ttft_ms:.2f} ms), service step "
              f"{ov.step_ms:.3f} ms (batch-1 TPOT {ov.live_step_tpot_ms:.3f} ms)", flush=True)
    print(f"live: {len(workload)} requests against {url} ...", flush=True)
    return await live(url, "tiny", workload), ov


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nitsum bench fidelity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrival rate after rescaling (requests/s)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--policy", default="static-tp:1", help="policy of both the mesh and the simulator")
    p.add_argument("--device-table", type=Path, default=None,
                   help="device table JSON for the simulator (default: the shipped nitsum/data/costmodel/cpu.json)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip measuring the service overheads (compare the bare table only)")
    p.add_argument("--url", default=None, help="measure this running one-worker mesh instead of starting one")
    p.add_argument("--out", type=Path, default=None, help="write live/, sim/, sim-service/ and fidelity.json here")
    args = p.parse_args(argv)
    if args.requests < 2 or not args.rate > 0 or args.max_prompt_tokens < 1 or args.max_output_tokens < 1:
        p.error("need --requests >= 2, --rate > 0 and positive token caps")
    if args.device_table is not None and not args.device_table.is_file():
        p.error(f"--device-table: no such file {args.device_table}")
    workload = build_workload(args.trace, args.requests, args.rate, args.max_prompt_tokens, args.max_output_tokens)
    table = load_device_table(args.device_table)
    sim_result, table = simulate(workload, args.policy, table)
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
        trackers, ov = asyncio.run(_live_phase(url, workload, table, args.calibrate))
    finally:
        if mesh is not None:
            mesh.stop()
    live_records = [t.to_record() for t in trackers]
    live_report = summarize(live_records)
    print(f"live: {live_report.overall.succeeded}/{live_report.overall.requests} succeeded")
    rows = side_by_side(live_report, sim_result.report)
    worst, text = _verdict(rows)
    print(f"simulator on the device table ({table.source[:60]}...):")
    print(format_rows(rows))
    print(text)
    service_rows, service_worst, service_records, service_report = None, None, None, None
    if ov is not None:
        service_result, _ = simulate(workload, args.policy, adjusted_table(table, ov))
        service_records = shift_records(service_result.records, max(0.0, ov.path_ms))
        service_report = summarize(service_records)
        service_rows = side_by_side(live_report, service_report)
        service_worst, text = _verdict(service_rows)
        print(f"simulator on the table + measured service overheads (path {ov.path_ms:.2f} ms, step "
              f"+{ov.step_ms:.3f} ms):")
        print(format_rows(service_rows))
        print(text)
    if args.out:
        meta = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "date": time.strftime("%Y-%m-%d"), "machine": {"platform": platform.platform(),
                                                              "cpus": os.cpu_count()},
                "device_table": dataclasses.asdict(table),
                "service_overheads": None if ov is None else dataclasses.asdict(ov)}
        write_all(live_report, live_records, args.out / "live", meta, log_rows=(t.to_log() for t in trackers))
        write_all(sim_result.report, sim_result.records, args.out / "sim", meta)
        if service_report is not None:
            write_all(service_report, service_records, args.out / "sim-service", meta)
        (args.out / "fidelity.json").write_text(json.dumps(
            {**meta, "rows": rows, "worst_rel_error": worst, "service_rows": service_rows,
             "service_worst_rel_error": service_worst}, indent=2, default=str) + "\n")
    return 0
