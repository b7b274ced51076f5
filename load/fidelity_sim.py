"""`nitsum bench fidelity`'s simulator side: the trace slice, the evaluation / calibration rows, the cluster
simulator with the worker's batch limits, and one session's analysis (bare table, calibrated service model,
seeds)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from nitsum.metrics import RequestRecord
from nitsum.policy.costmodel import DeviceSpec, load_device_table
from nitsum.sim.service import Calibration, ServiceModel, calibrate_service_fixed_point
from nitsum.workloads import TraceRequest, scale_to_rate
from nitsum_load.workload import read_trace

# The worker's defaults (nitsum.config.WorkerConfig): the simulator must batch like the engine does.
WORKER_MAX_NUM_SEQS = 64
WORKER_MAX_BATCHED_TOKENS = 512
WORKER_BLOCK_SIZE = 16
FIXED_POINT_ROUNDS = 3  # calibration rounds against a simulation slowed by the typical ratio (sim/service.py)


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


def interleave(evaluation: list, calibration: list) -> list:
    """The inverse of split_rows."""
    assert 0 <= len(evaluation) - len(calibration) <= 1, "evaluation rows are the even ones"
    out = []
    for k, row in enumerate(evaluation):
        out.append(row)
        if k < len(calibration):
            out.append(calibration[k])
    return out


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
