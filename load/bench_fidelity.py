"""`nitsum bench fidelity`: the simulator against the live mesh on the same slice of a real trace.

Each session takes the next 2 x `--requests` rows of the Azure conversation trace, rescaled to `--rate`
requests/s (the trace's burstiness kept) and capped to `--max-prompt-tokens` / `--max-output-tokens` so the CPU
mesh sustains them; they are
- sent to a fresh live `nitsum up --devices 1 --policy P` by the load generator (token-id prompts on
  /v1/completions, so the prompt lengths are exact; ignore_eos, so the output lengths are exact), and
- replayed by the cluster simulator (`nitsum.sim.cluster`) with the same policy, one device, the worker's
  batch limits and step budget, and the CPU device table (nitsum/data/costmodel/cpu.json, which
  `nitsum bench profile` writes).
Rows alternate between **evaluation** (even rows) and **calibration** (odd rows). Both run on the mesh and in
the simulator together (they load the mesh together), but only the evaluation rows are compared and only the
calibration rows are used to measure the service model, so nothing is fitted to what is scored.

The device table times engine steps only. What the mesh adds (the request path through HTTP, gateway, NATS and
coordinator and back; the worker's per-step work around the engine; the slowdowns of a shared CPU) is measured
per session on its calibration rows as empirical distributions (`nitsum.sim.service.calibrate_service`): per
request, live TTFT - simulated TTFT (the path) and live TPOT / simulated TPOT (the decode-step ratio, drawn per
window as long as the longest calibration decode, a request keeping the draw of the window its decode starts in),
against a simulation of the session's slice slowed by the typical ratio (a fixed point from the bare table).
The simulator then runs again with that `ServiceModel` (seeded draws); the evaluation rows of all sessions are
pooled, and the simulator's figures are over all `--seeds` seeds pooled, with the range of single seeds beside
them. Both comparisons are printed, with the live figures' own bootstrap spread and where the live time goes
according to the services' spans. Goal: |error| <= 15%.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nitsum.metrics import Report, RequestRecord, percentile, summarize
from nitsum.policy.costmodel import DeviceSpec, load_device_table
from nitsum.sim.service import Calibration, ServiceModel, calibrate_service_fixed_point
from nitsum.workloads import TraceRequest, scale_to_rate
from nitsum_load.client import PROMPT_TOKEN_ID_SPAN, ClientConfig, RequestSpec
from nitsum_load.fidelity_diagnostics import (
    METRICS,
    PATH_PARTS,
    bootstrap_intervals,
    format_breakdown,
    metric_values,
    path_breakdown,
    per_request_rows,
    read_spans,
)
from nitsum_load.mesh import start_mesh
from nitsum_load.report import read_lifecycle_log, write_all
from nitsum_load.runner import run_open_loop
from nitsum_load.workload import Shaping, read_trace, shape

GOAL_REL_ERROR = 0.15
# The worker's defaults (nitsum.config.WorkerConfig): the simulator must batch like the engine does.
WORKER_MAX_NUM_SEQS = 64
WORKER_MAX_BATCHED_TOKENS = 512
WORKER_BLOCK_SIZE = 16
# Warm-up before the slice (dropped): the mesh's first requests pay one-off costs (connections, lazy imports,
# allocator growth). 8 prompt + 8 output tokens never fill a 16-token KV block: nothing lands in the prefix cache.
FIXED_POINT_ROUNDS = 3  # calibration rounds against a simulation slowed by the typical ratio (sim/service.py)
WARMUP_REQUESTS, WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS, WARMUP_GAP_MS = 6, 8, 8, 100.0


def build_workload(
    trace: str,
    n: int,
    rate_per_s: float,
    max_prompt: int,
    max_output: int,
    first_row: int = 0,
) -> list[TraceRequest]:
    """Rows [first_row, first_row + n) of the trace, rescaled to the rate, capped, starting at 0 ms."""
    rows = read_trace(trace, limit=first_row + n)[first_row:]
    if len(rows) < n:
        raise ValueError(f"{trace} has {len(rows) + first_row} rows, the slice needs {first_row + n}")
    reqs = scale_to_rate(rows, rate_per_s)
    t0 = reqs[0].arrival_ms
    return [
        dataclasses.replace(
            r,
            arrival_ms=r.arrival_ms - t0,
            prompt_tokens=min(r.prompt_tokens, max_prompt),
            output_tokens=min(r.output_tokens, max_output),
        )
        for r in reqs
    ]


def split_rows(rows: list) -> tuple[list, list]:
    """(evaluation, calibration): even and odd positions, so both sample the same stretch of the run."""
    return rows[0::2], rows[1::2]


def simulate(
    workload: list[TraceRequest], policy: str, table: DeviceSpec | None = None, service: ServiceModel | None = None
) -> Any:
    """The simulator on a CPU device table (default: the shipped nitsum/data/costmodel/cpu.json, what
    `nitsum bench profile` writes), one device, the worker's batch limits, optionally a service model.
    Returns (result, table)."""
    from nitsum.sim.cluster import ClusterConfig, run_cluster

    table = table or load_device_table(None)
    config = ClusterConfig(
        model="tiny",
        device_kind=table,
        num_nodes=1,
        devices_per_node=1,
        min_tp=1,
        max_tp=1,
        chunk_tokens=WORKER_MAX_BATCHED_TOKENS,
        max_batch=WORKER_MAX_NUM_SEQS,
        block_size_tokens=WORKER_BLOCK_SIZE,
        drain_ms=120_000.0,
        service=service,
        # nitsum's engine: no SLO-aware chunk, its 512-token budget pays for decodes too
        tpot_aware_chunks=False,
        decode_tokens_in_budget=True,
    )
    return run_cluster(policy, config, workload), table


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


def side_by_side(live_report: Report, sim_report: Report) -> list[dict[str, Any]]:
    return compare(metric_values(live_report), metric_values(sim_report))


def compare(
    live_values: list[float | None],
    sim_values: list[float | None],
    sim_ranges: list[tuple[float, float] | None] | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for k, ((dist, stat), a, b) in enumerate(zip(METRICS, live_values, sim_values)):
        err = None if a is None or b is None or a == 0 else (b - a) / a
        row = {"metric": f"{dist.split('_')[0].upper()} {stat} (ms)", "live": a, "sim": b, "rel_error": err}
        if sim_ranges is not None:
            row["sim_range"] = sim_ranges[k]
        rows.append(row)
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    ranged = any(r.get("sim_range") for r in rows)
    lines = [
        f"{'metric':<16}{'live mesh':>12}{'simulator':>12}{'sim error':>12}" + ("   sim over seeds" if ranged else "")
    ]
    for r in rows:
        live_s = "-" if r["live"] is None else f"{r['live']:.2f}"
        sim_s = "-" if r["sim"] is None else f"{r['sim']:.2f}"
        err_s = "-" if r["rel_error"] is None else f"{r['rel_error'] * 100:+.1f}%"
        span = r.get("sim_range")
        extra = f"   {span[0]:.2f}-{span[1]:.2f}" if span else ""
        lines.append(f"{r['metric']:<16}{live_s:>12}{sim_s:>12}{err_s:>12}{extra}")
    return "\n".join(lines)


def _verdict(rows: list[dict[str, Any]]) -> tuple[float | None, str]:
    errs = [abs(r["rel_error"]) for r in rows if r["rel_error"] is not None]
    worst = max(errs) if errs else None
    verdict = "-" if worst is None else ("within" if worst <= GOAL_REL_ERROR else "outside")
    return (
        worst,
        f"worst error {'-' if worst is None else f'{worst * 100:.1f}%'} ({verdict} the {GOAL_REL_ERROR:.0%} goal)",
    )


def over_seeds(per_seed: list[list[float | None]]) -> tuple[list[float | None], list[tuple[float, float] | None]]:
    """Median and (min, max) of each metric over the seeds."""
    medians, ranges = [], []
    for k in range(len(METRICS)):
        xs = [v[k] for v in per_seed if v[k] is not None]
        medians.append(statistics.median(xs) if xs else None)
        ranges.append((min(xs), max(xs)) if xs else None)
    return medians, ranges


def describe(cal: Calibration) -> str:
    m = cal.model
    q = statistics.quantiles
    path = q(m.path_ms, n=10) if len(m.path_ms) > 1 else [m.path_ms[0]] * 9
    ratio = q(m.step_ratios, n=10) if len(m.step_ratios) > 1 else [m.step_ratios[0]] * 9
    return (
        f"request path p10/p50/p90 {path[0]:.2f}/{path[4]:.2f}/{path[8]:.2f} ms ({cal.path_samples} samples, "
        f"{cal.path_clamped} clamped at 0, {cal.stalled} with all tokens at once); decode-step ratio p10/p50/p90 {ratio[0]:.2f}/{ratio[4]:.2f}/"
        f"{ratio[8]:.2f} ({cal.ratio_samples} samples, {cal.ratio_dropped} without a TPOT), one draw per "
        f"{m.noise_window_ms:.0f} ms"
    )


def interleave(evaluation: list, calibration: list) -> list:
    """The inverse of split_rows."""
    assert 0 <= len(evaluation) - len(calibration) <= 1, "evaluation rows are the even ones"
    out = []
    for k, row in enumerate(evaluation):
        out.append(row)
        if k < len(calibration):
            out.append(calibration[k])
    return out


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
        print(f"starting nitsum up --devices 1 --policy {args.policy} (logs in {run_dir}) ...", flush=True)
        mesh = start_mesh(run_dir, devices=1, extra_args=("--policy", args.policy))
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


@dataclass
class Session:
    """One fresh mesh (a fresh prefix cache: every session may reuse the 100 token-id prompts) on its own slice
    of the trace, with its own calibration: the machine's state differs from session to session."""

    index: int
    workload: list[TraceRequest]
    live: list[RequestRecord]  # row order (evaluation rows even, calibration rows odd)
    logs: list[dict]
    spans: list[dict]
    wall0_ms: float
    bare: list[RequestRecord] = field(default_factory=list)
    calibration: Calibration | None = None
    service: list[list[RequestRecord]] = field(default_factory=list)  # per seed: evaluation rows
    ratios_tried: list[float] = field(default_factory=list)  # the calibration's fixed point, from 1


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


def analyse(session: Session, args: argparse.Namespace, table: DeviceSpec) -> None:
    """The simulator on the session's slice: bare table, calibration, then the service model per seed."""
    session.bare = simulate(session.workload, args.policy, table)[0].records
    cal_rows = split_rows(session.live)[1]

    def calibration_rows_at(ratio: float) -> list[RequestRecord]:
        if ratio == 1.0:
            return split_rows(session.bare)[1]
        slowed = simulate(session.workload, args.policy, table, ServiceModel(step_ratios=(ratio,)))[0]
        return split_rows(slowed.records)[1]

    session.calibration, session.ratios_tried = calibrate_service_fixed_point(
        cal_rows, calibration_rows_at, FIXED_POINT_ROUNDS, source=f"{len(cal_rows)} calibration rows of {args.trace}"
    )
    for seed in range(args.seeds):
        result, _ = simulate(
            session.workload, args.policy, table, dataclasses.replace(session.calibration.model, seed=seed)
        )
        session.service.append(split_rows(result.records)[0])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="nitsum bench fidelity",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default="azure-conv")
    p.add_argument(
        "--requests", type=int, default=50, help="evaluation rows per session (as many calibration rows interleave)"
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=1,
        help="fresh meshes on consecutive slices of the trace, pooled (more requests for the p90s)",
    )
    p.add_argument("--rate", type=float, default=4.0, help="mean arrival rate after rescaling (requests/s)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--policy", default="static-tp:1", help="policy of both the mesh and the simulator")
    p.add_argument(
        "--device-table",
        type=Path,
        default=None,
        help="device table JSON for the simulator (default: the shipped nitsum/data/costmodel/cpu.json)",
    )
    p.add_argument(
        "--seeds", type=int, default=40, help="simulator runs with the service model (figures over all of them pooled)"
    )
    p.add_argument("--url", default=None, help="measure this running one-worker mesh instead of starting one")
    p.add_argument(
        "--replay",
        type=Path,
        default=None,
        help="no live run: the live records of a run saved with --out (its slice settings win)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write session-K/{live,live-calibration}, sim/, sim-service/, requests.csv, path.csv and "
        "fidelity.json here",
    )
    args = p.parse_args(argv)
    saved: dict[str, Any] = {}
    if args.replay is not None:
        if not (args.replay / "fidelity.json").is_file():
            p.error(f"--replay: {args.replay} holds no fidelity.json (a directory written by --out)")
        saved = json.loads((args.replay / "fidelity.json").read_text())
        for key in ("trace", "requests", "sessions", "rate", "max_prompt_tokens", "max_output_tokens", "policy"):
            setattr(args, key, saved["settings"][key])
    if args.requests < 2 or not args.rate > 0 or args.max_prompt_tokens < 1 or args.max_output_tokens < 1:
        p.error("need --requests >= 2, --rate > 0 and positive token caps")
    if 2 * args.requests > PROMPT_TOKEN_ID_SPAN:
        # Token-id prompt i is ids 100 + (i + j) mod 100: rows i and i + 100 would share their prompt and hit the
        # engine's prefix cache, which the simulator does not model.
        p.error(f"--requests at most {PROMPT_TOKEN_ID_SPAN // 2}: more rows would repeat prompts")
    if args.sessions < 1 or (args.url is not None and args.sessions > 1):
        p.error("--sessions must be >= 1, and 1 with --url (a running mesh keeps its prefix cache)")
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.device_table is not None and not args.device_table.is_file():
        p.error(f"--device-table: no such file {args.device_table}")
    table = load_device_table(args.device_table)
    if table.placeholder:
        print("warning: the CPU device table holds placeholder figures; run `nitsum bench profile` first", flush=True)
    sessions = []
    for k in range(args.sessions):
        workload = build_workload(
            args.trace,
            2 * args.requests,
            args.rate,
            args.max_prompt_tokens,
            args.max_output_tokens,
            first_row=2 * args.requests * k,
        )
        if args.replay is None:
            sessions.append(Session(k, workload, *run_live(args, workload)))
        else:
            sessions.append(replayed(args.replay, k, workload, saved["wall0_unix_ms"][k]))
            print(f"replaying session {k} of {args.replay}")
        analyse(sessions[-1], args, table)
        print(
            f"  session {k} service model: {describe(sessions[-1].calibration)}; typical ratio "
            + " -> ".join(f"{m:.2f}" for m in sessions[-1].ratios_tried),
            flush=True,
        )

    live_eval = [r for s in sessions for r in split_rows(s.live)[0]]
    bare_eval = [r for s in sessions for r in split_rows(s.bare)[0]]
    service_by_seed = [[r for s in sessions for r in s.service[seed]] for seed in range(args.seeds)]
    live_report = summarize(live_eval)
    print(
        f"live: {live_report.overall.succeeded}/{live_report.overall.requests} evaluation requests succeeded "
        f"({args.sessions} session(s))"
    )
    rows = side_by_side(live_report, summarize(bare_eval))
    worst, text = _verdict(rows)
    print(f"simulator on the device table alone ({table.source[:60]}...):")
    print(format_rows(rows))
    print(text)
    # The simulator's figure is over all seeds' records pooled: an estimate of the model's own percentile, as
    # the live one is of the mesh's (one seed's p90 over a heavy-tailed path rests on a handful of draws);
    # the range over single seeds is printed beside it.
    per_seed = [metric_values(summarize(records)) for records in service_by_seed]
    _, ranges = over_seeds(per_seed)
    pooled = metric_values(summarize([r for records in service_by_seed for r in records]))
    service_rows = compare(metric_values(live_report), pooled, ranges)
    service_worst, text = _verdict(service_rows)
    print(f"simulator on the table + each session's measured service model ({args.seeds} seeds pooled):")
    print(format_rows(service_rows))
    print(text)
    spread = bootstrap_intervals(live_eval)
    print(
        "live figures' own sampling spread (5-95% over resamples of the evaluation requests): "
        + ", ".join(
            r["metric"].split(" (")[0] + " " + ("-" if iv is None else f"{iv[0]:.2f}-{iv[1]:.2f}")
            for r, iv in zip(service_rows, spread)
        )
    )
    breakdown = [row for s in sessions for row in path_breakdown(s.logs, s.spans, s.wall0_ms)]
    if breakdown:
        bare_all = [r for s in sessions for r in s.bare]
        print(format_breakdown(breakdown))
        print(
            "  simulated on the bare table, same requests: engine TTFT p50/p90 "
            + "/".join(f"{percentile([r.ttft_ms for r in bare_all if r.ttft_ms is not None], q):.2f}" for q in (50, 90))
            + ", engine time of a request (arrival to last token) p50/p90 "
            + "/".join(
                f"{percentile([r.finish_ms - r.send_ms for r in bare_all if r.finish_ms is not None], q):.2f}"
                for q in (50, 90)
            )
        )
    if args.out:
        write_outputs(
            args,
            table,
            sessions,
            live_report,
            live_eval,
            bare_eval,
            service_by_seed[0],
            breakdown,
            {
                "rows": rows,
                "worst_rel_error": worst,
                "service_rows": service_rows,
                "service_worst_rel_error": service_worst,
                "service_per_seed": per_seed,
                "live_spread": spread,
            },
        )
    return 0


def write_outputs(
    args: argparse.Namespace,
    table: DeviceSpec,
    sessions: list[Session],
    live_report: Report,
    live_eval: list,
    bare_eval: list,
    service_eval: list,
    breakdown: list[dict],
    figures: dict[str, Any],
) -> None:
    out = args.out
    meta = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "device_table": dataclasses.asdict(table),
        "wall0_unix_ms": [s.wall0_ms for s in sessions],
    }
    for s in sessions:
        d = out / f"session-{s.index}"
        evaluation, calibration = split_rows(s.live)
        write_all(summarize(evaluation), evaluation, d / "live", meta, log_rows=s.logs[0::2])
        write_all(summarize(calibration), calibration, d / "live-calibration", meta, log_rows=s.logs[1::2])
        if s.spans:
            (d / "spans.jsonl").write_text("".join(json.dumps(sp) + "\n" for sp in s.spans))
    write_all(live_report, live_eval, out / "live", meta)
    write_all(summarize(bare_eval), bare_eval, out / "sim", meta)
    write_all(summarize(service_eval), service_eval, out / "sim-service", meta)
    if breakdown:
        with (out / "path.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["request_id", *PATH_PARTS])
            writer.writeheader()
            writer.writerows(breakdown)
    table_rows = per_request_rows(live_eval, bare_eval, service_eval)
    with (out / "requests.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table_rows[0]))
        writer.writeheader()
        writer.writerows(table_rows)
    calibrations = [
        {
            "service_model": dataclasses.asdict(s.calibration.model),
            "ratios_tried": s.ratios_tried,
            **{k: v for k, v in dataclasses.asdict(s.calibration).items() if k != "model"},
        }
        for s in sessions
    ]
    (out / "fidelity.json").write_text(
        json.dumps({**meta, **figures, "calibrations": calibrations}, indent=2, default=str) + "\n"
    )
