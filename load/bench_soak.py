"""`nitsum bench soak`: steady load on the live mesh for N minutes while workers are killed and NATS restarts.

    nitsum bench soak --minutes 10 --kill-every 2 --out /tmp/soak        # about 70% of measured capacity
    nitsum bench soak --quick --out /tmp/soak-quick                      # 1 minute, one kill, one NATS restart

Steps: start a nats-server of our own (so it can be restarted) and `nitsum up --devices N --nats URL`; measure
capacity with a short ramp of Poisson steps (`--rate` skips it); then send open-loop Poisson load at
`--load-fraction` of it while, on a fixed schedule, a worker is SIGKILLed (pid from the run's processes.json;
`nitsum up` restarts it) every `--kill-every` minutes and NATS is stopped and restarted once. A fault window runs
from the fault to `--grace-s` after recovery (the mesh has every worker ready again and /ready answers 200); a
request counts as inside one when its lifetime overlaps it. Reported: requests sent, completed, failed inside and
outside fault windows (goal outside: 0), lost = sent but never ended by the server (cancelled at the end, or a
client timeout; goal 0), and per process the RSS (/proc/<pid>/status VmRSS) and the asyncio task count
(`nitsum_asyncio_tasks` from each service's /metrics) over time, with the slope after warm-up (goal: flat).

Files in --out: soak.md (summary), soak.json, soak_series.csv (t_s, process, pid, rss_mib, asyncio_tasks),
soak_requests.csv, soak.png, and load/ (the `nitsum load` report of the soak phase).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nitsum.metrics import summarize
from nitsum.natsserver import NatsServer, free_port
from nitsum_load.client import ClientConfig, RequestSpec, RequestTracker
from nitsum_load.mesh import LocalMesh, start_mesh
from nitsum_load.report import format_table
from nitsum_load.soak_core import (
    PlannedFault,
    Sample,
    count_outcomes,
    fault_windows,
    outcome_of,
    plan_faults,
    summarize_series,
)
from nitsum_load.soak_load import RampStep, fire_timed, measure_capacity, poisson_specs
from nitsum_load.soak_probes import RECOVERY_TIMEOUT_S, FaultInjector, sampler
from nitsum_load.soak_report import write_outputs

# The pieces live in soak_core (pure: schedule, windows, counts, slopes), soak_probes (processes, probes, the
# fault injector), soak_load (load and the capacity ramp) and soak_report (the files written).


async def soak(args: argparse.Namespace, gateway_url: str, nats: NatsServer, run_dir: Path) -> dict[str, Any]:
    from nitsum_load.cli import discover_model

    model = await discover_model(gateway_url, None)
    # Token-id prompts on /v1/completions and ignore_eos: every request has exactly the lengths asked for.
    cfg = ClientConfig(
        base_url=gateway_url,
        model=model,
        endpoint="completions",
        prompt_format="token-ids",
        return_token_ids=True,
        ignore_eos=True,
        request_timeout_s=args.request_timeout,
    )
    steps: list[RampStep] = []
    capacity = None
    if args.rate is not None:
        rate = args.rate
    else:
        print("measuring capacity (Poisson ramp) ...", flush=True)
        capacity, steps = await measure_capacity(cfg, args)
        rate = capacity * args.load_fraction
    duration_s = args.minutes * 60.0
    plan = plan_faults(
        duration_s,
        args.kill_every * 60.0,
        args.devices,
        max_kills=args.max_kills,
        nats_restart=not args.no_nats_restart,
        tail_s=min(10.0, duration_s / 4),
    )
    specs = poisson_specs(rate, duration_s, args.prompt_tokens, args.output_tokens, seed=args.seed)
    print(
        f"soak: {len(specs)} requests at {rate:.2f} req/s for {duration_s:.0f} s; faults: "
        + ", ".join(f"{f.kind} {f.target} @{f.at_s:.0f}s" for f in plan),
        flush=True,
    )

    rows, run_end_s, samples, injector = await _run_under_faults(args, specs, cfg, plan, gateway_url, nats, run_dir)

    outcomes = [outcome_of(tracker, ended_ms) for tracker, ended_ms in rows]
    windows = fault_windows(injector.records, args.grace_s, run_end_s)
    counts = count_outcomes(outcomes, windows, run_end_s)
    trackers = [t for t, _ in rows]
    records = [t.to_record() for t in trackers]
    report = summarize(records)
    series = summarize_series(samples, args.warmup_s)

    result = {
        "command": "nitsum bench soak " + " ".join(args.argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "devices": args.devices,
        "capacity_rps": capacity,
        "rate_rps": rate,
        "duration_s": duration_s,
        "run_end_s": run_end_s,
        "warmup_s": args.warmup_s,
        "grace_s": args.grace_s,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "ramp": [asdict(s) for s in steps],
        "planned_faults": [asdict(f) for f in plan],
        "faults": [asdict(f) for f in injector.records],
        "windows": [asdict(w) for w in windows],
        "counts": asdict(counts),
        "series": [asdict(s) for s in series],
        "ttft_ms": report.overall.to_dict()["ttft_ms"],
        "tpot_ms": report.overall.to_dict()["tpot_ms"],
    }
    write_outputs(args.out, result, samples, outcomes, injector.records, windows, report, records, trackers)
    print(format_table(report))
    return result


async def _run_under_faults(
    args: argparse.Namespace,
    specs: Sequence[RequestSpec],
    cfg: ClientConfig,
    plan: Sequence[PlannedFault],
    gateway_url: str,
    nats: NatsServer,
    run_dir: Path,
) -> tuple[list[tuple[RequestTracker, float | None]], float, list[Sample], FaultInjector]:
    """The soak phase: the load, the fault schedule and the sampler side by side on one clock. Returns each
    request's tracker and end time, when the load ended (soak clock, s), the samples and the injector (its
    records are the faults as they happened)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stop = asyncio.Event()
    samples: list[Sample] = []
    injector = FaultInjector(nats, nats.url, run_dir, gateway_url, args.devices, args.nats_down_s, t0, args.out)
    sampling = asyncio.create_task(sampler(stop, args.sample_s, t0, run_dir, gateway_url, nats, samples))
    faulting = asyncio.create_task(injector.run(plan))
    try:
        rows = await fire_timed(specs, cfg, t0, drain_timeout_s=args.request_timeout + 5.0)
        run_end_s = loop.time() - t0
        await asyncio.wait_for(faulting, timeout=RECOVERY_TIMEOUT_S + 30.0)  # a last recovery may still run
    finally:
        faulting.cancel()
        stop.set()
        await asyncio.gather(sampling, faulting, return_exceptions=True)
    return rows, run_end_s, samples, injector


QUICK = {
    "minutes": 1.0,
    "kill_every": 0.5,
    "max_kills": 1,
    "warmup_s": 10.0,
    "sample_s": 1.0,
    "ramp_step_s": 4.0,
    "ramp_max_steps": 5,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nitsum bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=None, help="soak length (default 10; --quick 1)")
    p.add_argument(
        "--kill-every",
        type=float,
        default=None,
        metavar="MIN",
        help="SIGKILL a worker every MIN minutes (default 2; --quick: once, half-way)",
    )
    p.add_argument("--max-kills", type=int, default=None, help="at most this many kills")
    p.add_argument("--no-nats-restart", action="store_true", help="skip the NATS restart")
    p.add_argument("--quick", action="store_true", help="1 minute, one kill, one NATS restart, short ramp")
    p.add_argument("--devices", type=int, default=2, help="workers of the mesh (default 2: one spare)")
    p.add_argument("--policy", default=None, help="mesh policy (default: nitsum up's)")
    p.add_argument("--rate", type=float, default=None, metavar="RPS", help="offered rate; skips the capacity ramp")
    p.add_argument("--load-fraction", type=float, default=0.7, help="offered rate / measured capacity")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--ramp-start-rate", type=float, default=2.0, metavar="RPS")
    p.add_argument("--ramp-step-s", type=float, default=None, help="seconds per ramp step (default 8; --quick 4)")
    p.add_argument("--ramp-max-steps", type=int, default=None, help="default 12; --quick 5")
    p.add_argument("--ramp-ttft-ms", type=float, default=1000.0, help="a ramp step with TTFT p90 above is overload")
    p.add_argument("--grace-s", type=float, default=15.0, help="a fault window ends this long after recovery")
    p.add_argument("--warmup-s", type=float, default=None, help="series slopes start here (default 60; --quick 10)")
    p.add_argument("--sample-s", type=float, default=None, help="RSS / task sampling period (default 5; --quick 1)")
    p.add_argument("--nats-down-s", type=float, default=1.0, help="how long NATS stays down")
    p.add_argument("--request-timeout", type=float, default=60.0, metavar="S")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="report directory (default runs/soak-<time>)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    defaults = (
        QUICK
        if args.quick
        else {
            "minutes": 10.0,
            "kill_every": 2.0,
            "max_kills": None,
            "warmup_s": 60.0,
            "sample_s": 5.0,
            "ramp_step_s": 8.0,
            "ramp_max_steps": 12,
        }
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.minutes > 0 or not args.kill_every > 0 or not args.sample_s > 0 or not args.ramp_step_s > 0:
        p.error("--minutes, --kill-every, --sample-s and --ramp-step-s must be > 0")
    if args.devices < 1 or args.ramp_max_steps < 1 or (args.max_kills is not None and args.max_kills < 0):
        p.error("need --devices >= 1, --ramp-max-steps >= 1 and --max-kills >= 0")
    if args.rate is not None and not args.rate > 0:
        p.error("--rate must be > 0")
    if not 0 < args.load_fraction <= 1 or args.prompt_tokens < 1 or args.output_tokens < 1:
        p.error("need 0 < --load-fraction <= 1 and positive token counts")
    args.out = args.out or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S")
    args.argv = list(argv)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    mesh_dir = Path(tempfile.mkdtemp(prefix="nitsum-bench-soak-"))
    # Our own nats-server (no auth): the soak must be able to stop and restart it under the running mesh.
    nats = NatsServer(port=free_port(), config_path=None).start(log_path=args.out / "nats-server.log")
    mesh: LocalMesh | None = None
    try:
        extra = ("--nats", nats.url, *(("--policy", args.policy) if args.policy else ()))
        print(f"starting nitsum up --devices {args.devices} --nats {nats.url} (logs in {mesh_dir}) ...", flush=True)
        mesh = start_mesh(mesh_dir, devices=args.devices, extra_args=extra)
        result = asyncio.run(soak(args, mesh.url, nats, mesh_dir / "run"))
    except RuntimeError as exc:
        sys.stderr.write(f"nitsum bench soak: {exc}\n")
        return 1
    finally:
        if mesh is not None:
            mesh.stop()
        nats.stop()
    c = result["counts"]
    print(
        f"sent {c['sent']}, completed {c['completed']}, failed inside fault windows {c['failed_in_windows']}, "
        f"outside {c['failed_outside_windows']} (goal 0), lost {c['lost']} (goal 0); report in {args.out}"
    )
    return 0
