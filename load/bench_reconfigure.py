"""`nitsum bench reconfigure`: how long a TP change takes, against restarting the workers at the new TP.

Live (default, `--live`): starts `nitsum up --devices 4` (its own nats-server, a fresh model directory, the
policy's own epochs switched off so only this benchmark changes the topology), streams `--requests` greedy
completions and, while they stream, drives the admin plane (`nitsum.admin.set-topology`) through
4xTP1 -> TP4 -> 2xTP2 -> TP4 -> 2xTP2 -> 4xTP1: merges 4xTP1->TP4 and 2xTP2->TP4, splits TP4->2xTP2 and
2xTP2->4xTP1. Per transition it reports the coordinator's phases from the admin answer (decide: 0 for an
admin command, which skips the policy; prepare; pause = commit; total), the admin round trip as the client
saw it, and the stream-visible pause: the largest gap between two consecutive tokens of any stream that
starts before the next change and ends after this one was sent, minus one reference step: the longer of
the steady steps of the stretch just before the change (old TP) and just after it (new TP) -- with no pause
at all, the gap across a change is one step of the old or the new TP (per stream the mean token gap, median
over streams; also in steps). The stricter figure against the old TP's step only is reported beside it.
The coordinator's `nitsum_reconfiguration_duration_ms` histogram (its /metrics port, found through
`<run-dir>/processes.json`) is read at the end as a cross-check of the phase sums.

Baseline, measured in the same run: restart the workers at the new TP with a weight reload. Timed exactly:
(1) stop: Ctrl-C to `nitsum up` until it has exited; (2) the shared-memory weight store of the model is
deleted, so every worker boot reads the checkpoint again; (3) boot: a fresh `nitsum up` with the same model
and flags (the nats-server stays up) from process start until GET /ready answers 200 and the coordinator
lists every worker ready; (4) for a target other than 4xTP1 (where workers boot), the set-topology round
trip on the fresh, idle mesh. restart(target) = (1) + (3) + (4). The ratio is restart(target) / the
transition's admin round trip (client side, so it includes NATS).

`--engine`: the engine-level version (no NATS; worker processes with a scripted coordinator), in bench_reconfigure_engine.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

# Re-exported: the policy benches and tests take the live mesh shell's admin_call & co. from here.
from nitsum.natsserver import free_port  # noqa: F401
from nitsum_load.live_mesh import admin_call, make_model, remove_weight_store, start_live_mesh  # noqa: F401
from nitsum_load.reconfigure_core import CHAINS
from nitsum_load.reconfigure_live import measure_live
from nitsum_load.reconfigure_report import build_live_report, print_live_summary, write_timeline_plot

# The pure part (chains, gaps, pauses, pre-copy lines, the restart baseline's sum) is nitsum_load.reconfigure_core,
# the live run nitsum_load.reconfigure_live, its report nitsum_load.reconfigure_report; the live mesh shell
# (LiveMesh, start_live_mesh, admin_call, ...) is nitsum_load.live_mesh; the engine-level benchmark is
# nitsum_load.bench_reconfigure_engine.


def live_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nitsum bench reconfigure [--live]", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mid", help="mid (a ~27M-param random Llama, default) | tiny | a model directory")
    p.add_argument("--requests", type=int, default=6, help="greedy streams in flight across the changes")
    p.add_argument(
        "--steady-tokens",
        type=int,
        default=12,
        help="tokens every stream decodes before the first change and after each one",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=1500,
        help="output tokens asked per stream; streams are cancelled once the chain is done",
    )
    p.add_argument("--rounds", type=int, default=1, help="times the chain of changes is repeated")
    p.add_argument(
        "--devices",
        type=int,
        choices=sorted(CHAINS),
        default=4,
        help="workers: 4 (4xTP1 -> TP4 -> 2xTP2 -> TP4 -> 2xTP2 -> 4xTP1, default) or 2 "
        "(2xTP1 -> TP2 -> 2xTP1, twice: one worker per core on a 2-core machine)",
    )
    p.add_argument(
        "--advance-timeout-s",
        type=float,
        default=60.0,
        help="longest wait for the streams to move on after a change (a stalled hand-off)",
    )
    p.add_argument(
        "--stream-timeout-s",
        type=float,
        default=None,
        help="the gateway's NITSUM_STREAM_TIMEOUT_S (default: its own, 30 s): how long a silent "
        "stream waits before it is re-routed",
    )
    p.add_argument("--out", type=Path, default=None, help="report directory (default runs/reconfigure-<time>)")
    p.add_argument("--json", type=Path, default=None, help="also write report.json here")
    return p


def live_main(argv: list[str]) -> int:
    p = live_parser()
    args = p.parse_args(argv)
    if args.requests < 1 or args.steady_tokens < 2 or args.rounds < 1:
        p.error("need --requests >= 1, --steady-tokens >= 2 and --rounds >= 1")
    needed = (len(CHAINS[args.devices]) * args.rounds + 2) * args.steady_tokens
    if args.max_tokens < needed:
        p.error(f"--max-tokens must be at least {needed} to stream across the whole chain")
    out = args.out or Path("runs") / time.strftime("reconfigure-%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # Only this benchmark changes the topology: the policy's own epochs are pushed out of the run.
    env_extra = {"NITSUM_RECONFIG_INTERVAL_MS": "600000"}
    if args.stream_timeout_s is not None:
        env_extra["NITSUM_STREAM_TIMEOUT_S"] = str(args.stream_timeout_s)
    measured = measure_live(p, args, out, env_extra)
    if measured is None:
        return 1
    run, restart, histogram, store_bytes = measured
    meta = {
        "mode": "live",
        "command": "nitsum bench reconfigure " + " ".join(argv),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "model": args.model,
        "weight_store_bytes": store_bytes,
        "devices": args.devices,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "date": time.strftime("%Y-%m-%d"),
    }
    report = build_live_report(run, restart, histogram, meta)
    text = json.dumps(report, indent=2)
    (out / "report.json").write_text(text)
    if args.json:
        args.json.write_text(text)
    write_timeline_plot(report, out / "timeline.png")
    print_live_summary(report, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--engine" in args:
        from nitsum_load.bench_reconfigure_engine import engine_main

        args.remove("--engine")
        return engine_main(args)
    if "--live" in args:
        args.remove("--live")
    return live_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
