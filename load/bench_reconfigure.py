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
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nitsum.natsserver import free_port
from nitsum_load.live_mesh import (  # noqa: F401  (re-exported: the policy benches and tests take admin_call & co. from here)
    ADMIN_TIMEOUT_S,
    MID_OVERRIDES,
    LiveMesh,
    admin_call,
    histogram_sums,
    make_model,
    remove_weight_store,
    start_live_mesh,
    weight_store_bytes,
)

TP1X4 = "[0 TP1 hybrid][1 TP1 hybrid][2 TP1 hybrid][3 TP1 hybrid]"
TP2X2 = "[0-1 TP2 hybrid][2-3 TP2 hybrid]"
TP4 = "[0-3 TP4 hybrid]"
TP1X2 = "[0 TP1 hybrid][1 TP1 hybrid]"
TP2 = "[0-1 TP2 hybrid]"
# (kind, from, to): every merge and split the brief asks for, starting and ending where workers boot.
CHAIN: tuple[tuple[str, str, str], ...] = (
    ("merge", TP1X4, TP4),
    ("split", TP4, TP2X2),
    ("merge", TP2X2, TP4),
    ("split", TP4, TP2X2),
    ("split", TP2X2, TP1X4),
)
# `--devices 2`: one worker per core on a 2-core machine (the 4-worker chain runs two processes per core).
CHAIN_2: tuple[tuple[str, str, str], ...] = (
    ("merge", TP1X2, TP2),
    ("split", TP2, TP1X2),
    ("merge", TP1X2, TP2),
    ("split", TP2, TP1X2),
)
SHAPE_NAMES = {TP1X4: "4xTP1", TP2X2: "2xTP2", TP4: "TP4", TP1X2: "2xTP1", TP2: "TP2"}
CHAINS = {4: CHAIN, 2: CHAIN_2}
BOOT_SHAPES = {4: TP1X4, 2: TP1X2}  # workers boot as one TP1 group each
# An inter-token gap this long is a stall (a hand-off the gateway did not follow), not a slow step.
STALL_MS = 1000.0


# ---------------------------------------------------------------- functional core (pure, no clock reads)


@dataclass(frozen=True)
class TransitionGap:
    max_gap_ms: float | None  # largest inter-token gap of any stream overlapping the transition window
    steady_ms: float | None  # median inter-token gap of the steady stretch before the window (old TP)
    streams_across: int  # streams with a gap overlapping the window
    steady_after_ms: float | None = None  # the same, of the stretch after the window (new TP)

    @property
    def reference_ms(self) -> float | None:
        """The step a gap across the change would take with no pause at all: the gap ends with the new
        group's first token, so it is one step of the old or of the new TP, whichever is longer (on 2 shared
        cores a TP4 step is 2-3x a TP1 step; charging that to the pause would count the new TP's own cost)."""
        known = [x for x in (self.steady_ms, self.steady_after_ms) if x is not None]
        return max(known) if known else None

    @property
    def pause_ms(self) -> float | None:
        """Stream-visible pause: the largest gap minus one reference step (what the stream lost)."""
        ref = self.reference_ms
        if self.max_gap_ms is None or ref is None:
            return None
        return max(0.0, self.max_gap_ms - ref)

    @property
    def pause_steps(self) -> float | None:
        p, ref = self.pause_ms, self.reference_ms
        return None if p is None or not ref else p / ref

    @property
    def pause_before_ms(self) -> float | None:
        """The older, stricter figure: the largest gap minus the steady step before the change only."""
        if self.max_gap_ms is None or self.steady_ms is None:
            return None
        return max(0.0, self.max_gap_ms - self.steady_ms)


def _stretch_step(token_times_ms: Sequence[Sequence[float]], lo: float, hi: float) -> float | None:
    """Steady step of the stretch [lo, hi]: per stream the mean gap of its tokens inside ((last - first) /
    (n - 1), so tokens the client read in one chunk, 0 ms apart, do not make it 0), then the median."""
    per_stream = []
    for times in token_times_ms:
        inside = [t for t in times if lo <= t <= hi]
        if len(inside) >= 3 and inside[-1] > inside[0]:
            per_stream.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.median(per_stream) if per_stream else None


def transition_gaps(
    token_times_ms: Sequence[Sequence[float]], windows_ms: Sequence[tuple[float, float]]
) -> tuple[float | None, list[TransitionGap]]:
    """Steady step (median over transitions) and, per window [start, end] (admin call sent .. answered), the
    largest gap from that change on against the steady steps of the stretch since the previous window ended
    (old TP) and of the stretch from this window's end to the next window's start (new TP).

    A gap (a, b) belongs to change k when b > start_k and a < start_{k+1}."""
    out = []
    prev_end = float("-inf")
    for k, (s, e) in enumerate(windows_ms):
        # Gaps that end after the call was sent and start before the next change: a stream that stalls after
        # the answer (its new leader not followed) counts against this change too.
        until = windows_ms[k + 1][0] if k + 1 < len(windows_ms) else float("inf")
        across = [
            (b - a, i)
            for i, times in enumerate(token_times_ms)
            for a, b in zip(times, times[1:])
            if b > s and a < until
        ]
        out.append(
            TransitionGap(
                max(g for g, _ in across) if across else None,
                _stretch_step(token_times_ms, prev_end, s),
                len({i for _, i in across}),
                _stretch_step(token_times_ms, e, until),
            )
        )
        prev_end = e
    steady = [g.steady_ms for g in out if g.steady_ms is not None]
    return (statistics.median(steady) if steady else None), out


def stalls(token_times_ms: Sequence[Sequence[float]], threshold_ms: float) -> int:
    """Inter-token gaps of at least threshold_ms: a hand-off the gateway did not follow shows as one."""
    return sum(1 for times in token_times_ms for a, b in zip(times, times[1:]) if b - a >= threshold_ms)


_PRECOPY_LINE = re.compile(
    r"epoch (\d+): prepare step ([\d.]+) ms .*?pre-copy of (\d+) flow\(s\) \+ (\d+) local copy\(ies\), "
    r"(\d+) chunk\(s\), (\d+) bytes, done ([\d.]+) ms"
)


def precopy_stats(log_lines: Sequence[str]) -> dict[int, dict[str, float]]:
    """Per epoch, from the old group leaders' log lines (services/worker/migration_flows.py): the longest
    prepare step (the part of prepare that stops a group), stage-M flows, chunks and bytes pre-copied (all
    leaders), and the latest pre-copy end after its prepare ack was pending."""
    out: dict[int, dict[str, float]] = {}
    for line in log_lines:
        m = _PRECOPY_LINE.search(line)
        if m is None:
            continue
        epoch = int(m.group(1))
        row = out.setdefault(epoch, {"prepare_step_ms": 0.0, "flows": 0, "chunks": 0, "bytes": 0, "precopy_ms": 0.0})
        row["prepare_step_ms"] = max(row["prepare_step_ms"], float(m.group(2)))
        row["flows"] += int(m.group(3))
        row["chunks"] += int(m.group(5))
        row["bytes"] += int(m.group(6))
        row["precopy_ms"] = max(row["precopy_ms"], float(m.group(7)))
    return out


def restart_ms(stop_ms: float, boot_ms: float, to_target_ms: dict[str, float], target: str) -> float | None:
    """Restart baseline for one target shape: workers boot as N x TP1; other shapes need one more change."""
    if target in BOOT_SHAPES.values():
        return stop_ms + boot_ms
    return stop_ms + boot_ms + to_target_ms[target] if target in to_target_ms else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_live_table(report: dict) -> str:
    lines = [
        "| transition | decide ms | prepare ms | pause (commit) ms | total ms | admin round trip ms "
        "| stream pause ms (steps) | max gap / steady gap before, after ms | pause vs before only ms "
        "| restart+reload ms | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['transition']} | {_fmt(r['decide_ms'])} | {_fmt(r['prepare_ms'])} | {_fmt(r['pause_ms'])} | "
            f"{_fmt(r['total_ms'])} | {_fmt(r['admin_rtt_ms'])} | {_fmt(r['stream_pause_ms'])} "
            f"({_fmt(r['stream_pause_steps'])}) | {_fmt(r['max_gap_ms'])} / {_fmt(r['steady_gap_ms'])}, "
            f"{_fmt(r.get('steady_gap_after_ms'))} | {_fmt(r.get('stream_pause_before_ms'))} | "
            f"{_fmt(r['restart_ms'], '.0f')} | {_fmt(r['speedup'], '.0f')}x |"
        )
    return "\n".join(lines)


# The live mesh shell (LiveMesh, start_live_mesh, admin_call, ...) is nitsum_load.live_mesh; the engine-level
# benchmark is nitsum_load.bench_reconfigure_engine.

# ---------------------------------------------------------------- the live run


async def _stream_through_chain(mesh: LiveMesh, args: argparse.Namespace) -> dict:
    """Stream the requests; once each has `--steady-tokens` tokens, apply each change of the chain, letting
    every stream move on by `--steady-tokens` tokens after each answer."""
    import aiohttp

    from nitsum_load.cli import discover_model
    from nitsum_load.client import ClientConfig, RequestSpec, RequestTracker, send

    model = await discover_model(mesh.url, None)
    cfg = ClientConfig(
        base_url=mesh.url,
        model=model,
        endpoint="completions",
        prompt_format="token-ids",
        return_token_ids=True,
        request_timeout_s=600.0,
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    origin_unix = time.time()  # wall clock of clock() == 0, to line the timeline up with the services' logs

    def clock() -> float:
        return (loop.time() - t0) * 1000.0

    chain = list(CHAINS[args.devices]) * args.rounds
    trackers = [
        RequestTracker(RequestSpec(f"r{i}", 0.0, 16 + 37 * i % 200, args.max_tokens, "interactive", 1e9, 1e9, 1.0))
        for i in range(args.requests)
    ]
    windows: list[tuple[float, float]] = []
    answers: list[dict] = []
    import nats

    nc = await nats.connect(servers=[mesh.nats_url], connect_timeout=5)
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(send(session, cfg, t, clock, seed_index=i)) for i, t in enumerate(trackers)]

        async def advance(marks: list[int]) -> None:
            # A stream that stalls (see `stalled` in the report) is not waited for beyond the gateway's own
            # stream timeout: the chain goes on, and the stall shows as that transition's gap.
            deadline = loop.time() + args.advance_timeout_s
            while not all(task.done() for task in tasks) and loop.time() < deadline:
                if all(
                    len(t.token_times_ms) >= m + args.steady_tokens or task.done()
                    for t, m, task in zip(trackers, marks, tasks)
                ):
                    return
                await asyncio.sleep(0.005)

        await advance([0] * len(trackers))
        for _kind, _src, dst in chain:
            start = clock()
            answer = await admin_call(
                mesh.nats_url,
                "set-topology",
                {"topology": dst, "node_id": "node0", "id": f"bench-{len(answers)}"},
                nc=nc,
            )
            end = clock()
            if not answer.get("ok"):
                raise RuntimeError(f"set-topology {dst} failed: {answer}")
            windows.append((start, end))
            answers.append(answer)
            await advance([len(t.token_times_ms) for t in trackers])
        # The streams are long on purpose (a fast model must not finish them before the chain ends); what
        # is left of them after the last change is not part of the measurement.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await nc.close()
    return {
        "chain": chain,
        "windows": windows,
        "answers": answers,
        "origin_unix": origin_unix,
        "token_times_ms": [list(t.token_times_ms) for t in trackers],
        "streams": [{"tokens": len(t.token_times_ms), "error": t.error, "detail": t.error_detail} for t in trackers],
    }


def _restart_baseline(
    work: Path, mesh: LiveMesh, model_dir: Path, nats_url: str, env_extra: dict, devices: int = 4
) -> dict:
    stop_ms = mesh.stop()
    removed = remove_weight_store(model_dir)
    fresh = start_live_mesh(
        work / "restart", model_dir=model_dir, nats_url=nats_url, env_extra=env_extra, devices=devices
    )
    boot = BOOT_SHAPES[devices]
    # Each target shape of the chain from the boot shape, back to the boot shape in between.
    targets: list[str] = []
    for _kind, _src, dst in CHAINS[devices]:
        if dst != boot and dst not in targets:
            targets += [dst, boot]
    try:
        reloaded_bytes = weight_store_bytes(model_dir)
        to_target: dict[str, float] = {}
        for target in targets:
            t0 = time.monotonic()
            try:
                answer = asyncio.run(
                    admin_call(
                        nats_url,
                        "set-topology",
                        {"topology": target, "node_id": "node0", "id": f"restart-{target}"},
                        timeout_s=30.0,
                    )
                )
            except Exception as exc:  # nats-py timeout types vary; an unanswered change leaves that target out  # noqa: BLE001
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            if not answer.get("ok"):
                print(f"warning: set-topology {target} on the restarted mesh: {answer}", file=sys.stderr)
                continue
            if target != boot:
                to_target[target] = (time.monotonic() - t0) * 1000.0
    finally:
        fresh.stop()
        remove_weight_store(model_dir)
    return {
        "stop_ms": stop_ms,
        "ready_ms": fresh.ready_ms,
        "boot_ms": fresh.workers_ready_ms,
        "to_target_ms": {SHAPE_NAMES[k]: v for k, v in to_target.items()},
        "_to_target": to_target,
        "store_removed": removed,
        "store_reloaded_bytes": reloaded_bytes,
    }


def build_live_report(run: dict, restart: dict, histogram: dict | None, meta: dict) -> dict:
    steady_ms, per_window = transition_gaps(run["token_times_ms"], run["windows"])
    rows = []
    for (kind, src, dst), answer, (s, e), gap in zip(run["chain"], run["answers"], run["windows"], per_window):
        t = answer["transition"]
        base = restart_ms(restart["stop_ms"], restart["boot_ms"], restart["_to_target"], dst)
        rtt = e - s
        rows.append(
            {
                "transition": f"{kind} {SHAPE_NAMES[src]} -> {SHAPE_NAMES[dst]}",
                "epoch": t["epoch"],
                "decide_ms": t.get("decide_ms"),
                "prepare_ms": t["prepare_ms"],
                "pause_ms": t["pause_ms"],
                "total_ms": t["total_ms"],
                "admin_rtt_ms": rtt,
                "max_gap_ms": gap.max_gap_ms,
                "steady_gap_ms": gap.steady_ms,
                "steady_gap_after_ms": gap.steady_after_ms,
                "stream_pause_ms": gap.pause_ms,
                "stream_pause_steps": gap.pause_steps,
                "stream_pause_before_ms": gap.pause_before_ms,
                "streams_across": gap.streams_across,
                "restart_ms": base,
                "speedup": base / rtt if base is not None and rtt > 0 else None,
                **{f"worker_{k}": v for k, v in run.get("precopy", {}).get(t["epoch"], {}).items()},
            }
        )
    return {
        **meta,
        "steady_gap_ms": steady_ms,
        "rows": rows,
        "restart": {k: v for k, v in restart.items() if not k.startswith("_")},
        "coordinator_histogram_ms": histogram,
        "streams": run["streams"],
        "streams_failed": sum(1 for x in run["streams"] if x["error"] is not None),
        "stalls": stalls(run["token_times_ms"], STALL_MS),
        # Raw timeline (client clock, ms): each change's admin call (sent, answered) and every stream's
        # token arrivals, for a closer look at where a gap falls.
        "clock_origin_unix": run["origin_unix"],
        "windows_ms": [list(w) for w in run["windows"]],
        "token_times_ms": run["token_times_ms"],
    }


def live_main(argv: list[str]) -> int:
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
    args = p.parse_args(argv)
    if args.requests < 1 or args.steady_tokens < 2 or args.rounds < 1:
        p.error("need --requests >= 1, --steady-tokens >= 2 and --rounds >= 1")
    needed = (len(CHAINS[args.devices]) * args.rounds + 2) * args.steady_tokens
    if args.max_tokens < needed:
        p.error(f"--max-tokens must be at least {needed} to stream across the whole chain")
    out = args.out or Path("runs") / time.strftime("reconfigure-%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)

    from nitsum.natsserver import NatsServer

    # Only this benchmark changes the topology: the policy's own epochs are pushed out of the run.
    env_extra = {"NITSUM_RECONFIG_INTERVAL_MS": "600000"}
    if args.stream_timeout_s is not None:
        env_extra["NITSUM_STREAM_TIMEOUT_S"] = str(args.stream_timeout_s)
    with tempfile.TemporaryDirectory(prefix="nitsum-bench-reconfigure-") as tmp:
        work = Path(tmp)
        try:
            model_dir = make_model(args.model, work)
        except FileNotFoundError as exc:
            p.error(str(exc))
        nats = NatsServer(port=free_port(), config_path=None).start(log_path=out / "logs" / "nats-server.log")
        mesh: LiveMesh | None = None
        try:
            print(f"starting nitsum up --devices {args.devices} --model {model_dir} ...", flush=True)
            mesh = start_live_mesh(
                out / "logs" / "live", model_dir=model_dir, nats_url=nats.url, env_extra=env_extra, devices=args.devices
            )
            store_bytes = weight_store_bytes(model_dir)
            print(
                f"ready in {mesh.workers_ready_ms / 1000:.1f} s; streaming {args.requests} x {args.max_tokens} "
                f"tokens through {len(CHAINS[args.devices]) * args.rounds} changes ...",
                flush=True,
            )
            run = asyncio.run(_stream_through_chain(mesh, args))
            worker_logs = sorted(mesh.run_dir.glob("worker-*.log"))
            run["precopy"] = precopy_stats(
                [line for path in worker_logs for line in path.read_text(errors="replace").splitlines()]
            )
            histogram = None
            metrics_url = mesh.coordinator_metrics_url()
            if metrics_url:
                try:
                    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
                        histogram = histogram_sums(resp.read().decode(), "nitsum_reconfiguration_duration_ms")
                except (urllib.error.URLError, OSError):
                    histogram = None
            print("restart baseline: stop, delete the weight store, fresh nitsum up ...", flush=True)
            restart = _restart_baseline(out / "logs", mesh, model_dir, nats.url, env_extra, args.devices)
        except RuntimeError as exc:
            sys.stderr.write(f"nitsum bench reconfigure: {exc}\n(logs in {out / 'logs'})\n")
            return 1
        finally:
            if mesh is not None:
                mesh.stop()
            nats.stop()
            remove_weight_store(model_dir)
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
    rs = report["restart"]
    print(
        f"nitsum bench reconfigure (live): {args.devices} CPU workers, model {args.model} ({store_bytes / 1e6:.1f} MB "
        f"fp32), {args.requests} greedy streams, {meta['machine']}; steady token gap {_fmt(report['steady_gap_ms'])} ms"
    )
    print(format_live_table(report))
    targets = ", ".join(f"{k} +{v:.0f} ms" for k, v in rs["to_target_ms"].items())
    print(
        f"restart+reload = stop {rs['stop_ms']:.0f} ms + boot {rs['boot_ms']:.0f} ms (/ready at {rs['ready_ms']:.0f} ms; "
        f"store deleted, {rs['store_reloaded_bytes'] / 1e6:.1f} MB re-read) + set-topology on the idle restarted mesh ({targets})"
    )
    print(
        "worker side, per change: longest prepare step (stops a group) / stage-M flows / pre-copied MB / "
        "pre-copy end after the pending ack: "
        + "; ".join(
            f"{r['transition'].split()[0]} {_fmt(r.get('worker_prepare_step_ms'), '.0f')} ms / "
            f"{r.get('worker_flows', '-')} / {(r.get('worker_bytes') or 0) / 1e6:.1f} / {_fmt(r.get('worker_precopy_ms'), '.0f')} ms"
            for r in report["rows"]
        )
    )
    if histogram:
        print(
            "coordinator histogram (sum ms / count): "
            + ", ".join(f"{k} {v.get('sum', 0):.1f}/{v.get('count', 0):.0f}" for k, v in sorted(histogram.items()))
        )
    print(
        f"streams failed: {report['streams_failed']}/{args.requests}; token gaps >= {STALL_MS / 1000:.0f} s (stalled hand-offs): "
        f"{report['stalls']}"
    )
    worst = max((r["stream_pause_steps"] or 0.0) for r in report["rows"])
    least = min((r["speedup"] or 0.0) for r in report["rows"])
    print(
        f"goals: speedup >= 100x: {'met' if least >= 100 else 'NOT met'} (lowest {least:.0f}x); "
        f"stream pause <= 2 steps: {'met' if worst <= 2 else 'NOT met'} (worst {worst:.1f}); report in {out} "
        f"(timeline.png: every stream's inter-token gaps across the changes)"
    )
    return 0


def write_timeline_plot(report: dict, path: Path) -> None:
    """Every stream's inter-token gaps over the run (a point per token, at its arrival), each change's admin
    call shaded and labelled with its stream pause, the steady gaps of the stretches between changes dashed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    ax = fig.subplots()
    for i, times in enumerate(report["token_times_ms"]):
        pts = [(b / 1000.0, b - a) for a, b in zip(times, times[1:])]
        if pts:
            ax.plot(
                [t for t, _ in pts], [g for _, g in pts], ".", markersize=3, color=f"C{i % 10}", label=f"stream {i}"
            )
    windows = report["windows_ms"]
    for k, ((start, end), row) in enumerate(zip(windows, report["rows"])):
        ax.axvspan(start / 1000.0, end / 1000.0, color="tab:orange", alpha=0.25)
        pause = row.get("stream_pause_steps")
        ax.annotate(
            f"{row['transition']}\ntotal {row['total_ms']:.0f} ms, pause {_fmt(pause, '.1f')} steps",
            (start / 1000.0, 1.0 - 0.09 * (k % 2)),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            va="top",
        )
        until = windows[k + 1][0] if k + 1 < len(windows) else None
        steady = row.get("steady_gap_after_ms")
        if steady and until is not None:
            ax.hlines(steady, end / 1000.0, until / 1000.0, colors="gray", linestyles="dashed", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the streams started")
    ax.set_ylabel("gap to the previous token (ms, log)")
    ax.set_title(
        f"nitsum bench reconfigure ({report['model']}): inter-token gaps; shaded = a TP change's admin call; "
        "dashed = steady gap at the new TP"
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=110)


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
