"""`nitsum bench reconfigure --engine`: the engine-level benchmark (no NATS; worker processes with a scripted
coordinator). Its doc is ENGINE_DOC below; the live benchmark and the shared pieces are in bench_reconfigure."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nitsum.natsserver import free_port
from nitsum_load.mesh import run_all

# ---------------------------------------------------------------- engine level (`--engine`)

ENGINE_DOC = """Engine level (`--engine`, no NATS): `--workers` worker processes (gloo on 127.0.0.1, one per device, the tiny
model by default) serve greedy requests while a scripted coordinator merges and splits their groups:
2xTP2 -> TP4 -> 2xTP2 -> 4xTP1 -> TP4 (with 4 workers). Per transition it reports, as the slowest worker
saw them, the *prepare* phase from the command to its final ack (new cache, block-table exchange -- the
prepare step, which stops the old groups, shown in brackets -- then the pre-copy of full blocks through
shared memory between the old groups' decode steps, while the new runner is built in a thread) and the
*commit* phase (delta + cutover: the pause), their total, and
the decode pause a stream sees: the largest gap between consecutive tokens of one request across the
commit, next to the median gap between consecutive tokens in steady decoding.

Baseline, measured in the same run: restarting the workers at the new TP with a weight reload -- start the
worker processes, join the process groups, read the checkpoint from disk (a fresh weight store), build the
model and the KV cache -- timed from process start until every worker is ready.
"""


def _run_node(model_dir: str, workers: int, script: dict, work: Path, shm_dir: Path, timeout_s: float) -> list[dict]:
    script_path = work / "script.json"
    script_path.write_text(json.dumps(script))
    port = free_port()
    codes, logs = run_all(
        [
            [
                sys.executable,
                "-m",
                "nitsum.bench.node_run",
                "--model-dir",
                model_dir,
                "--rank",
                str(rank),
                "--world-size",
                str(workers),
                "--master-port",
                str(port),
                "--script",
                str(script_path),
                "--out",
                str(work / f"out{rank}.json"),
                "--shm-dir",
                str(shm_dir),
                "--num-kv-blocks",
                "256",
            ]
            for rank in range(workers)
        ],
        timeout_s,
    )
    if any(codes):
        raise RuntimeError("a worker failed:\n" + "\n---\n".join(logs))
    return [json.loads((work / f"out{rank}.json").read_text()) for rank in range(workers)]


def _restart_ms(model_dir: str, workers: int, tp: int, work: Path, timeout_s: float) -> float:
    """Start `workers` processes at TP=`tp` with an empty weight store (so the checkpoint is read)."""
    topology = [[s, tp] for s in range(0, workers, tp)]
    with tempfile.TemporaryDirectory(dir=_shm_root()) as shm:
        t0 = time.time()
        reports = _run_node(model_dir, workers, {"topology": topology, "events": []}, work, Path(shm), timeout_s)
    assert any(r["store_created"] and r["boot_bytes_read"] > 0 for r in reports), "the restart read no weights"
    return (max(r["ready_unix"] for r in reports) - t0) * 1000.0


def _shm_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _script(workers: int, num_requests: int, max_tokens: int, period: int) -> tuple[dict, list[tuple[str, int, list]]]:
    import random

    rng = random.Random(0)
    chain = [
        ("merge", [[0, workers]]),
        ("split", [[s, workers // 2] for s in range(0, workers, workers // 2)]),
        ("split", [[s, 1] for s in range(workers)]),
        ("merge", [[0, workers]]),
    ]
    start = [[s, workers // 2] for s in range(0, workers, workers // 2)]
    events: list[dict] = []
    for i in range(num_requests):
        leader = start[i % len(start)][0]
        prompt = [rng.randrange(256) for _ in range(rng.randrange(8, 64))]
        events.append(
            {
                "tick": 0,
                "kind": "add",
                "leader": leader,
                "request_id": f"r{i}",
                "prompt": prompt,
                "max_tokens": max_tokens,
            }
        )
    transitions = []
    for epoch, (name, groups) in enumerate(chain, start=1):
        commit_tick = period * epoch
        events.append({"tick": commit_tick - 3, "kind": "prepare", "epoch": epoch, "groups": groups})
        events.append({"tick": commit_tick, "kind": "commit", "epoch": epoch})
        transitions.append((name, commit_tick, groups))
    return {"topology": start, "events": events}, transitions


def _describe(groups: list) -> str:
    tps = [g[1] for g in groups]
    return f"{len(tps)}xTP{tps[0]}" if len(tps) > 1 else f"TP{tps[0]}"


def engine_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nitsum bench reconfigure --engine", description=ENGINE_DOC.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None, help="model directory (default: a fresh tiny model)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (a power of two >= 2)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--period", type=int, default=20, help="decode steps between transitions")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.workers < 2 or args.workers & (args.workers - 1):
        parser.error("--workers must be a power of two >= 2")
    if args.max_tokens < args.period * 5:
        parser.error("--max-tokens must cover every transition (at least 5 x --period)")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = args.model_dir
        if model_dir is None:
            from nitsum.model.tiny import make_tiny

            model_dir = str(make_tiny(work / "tiny-llama"))
        script, transitions = _script(args.workers, args.requests, args.max_tokens, args.period)
        with tempfile.TemporaryDirectory(dir=_shm_root()) as shm:
            reports = _run_node(model_dir, args.workers, script, work, Path(shm), args.timeout_s)
        restart = {
            tp: _restart_ms(model_dir, args.workers, tp, work, args.timeout_s)
            for tp in sorted({g[0][1] for _, _, g in transitions} | {args.workers // 2})
        }

    records = sorted((r for rep in reports for r in rep["records"]), key=lambda r: (r[1], r[2]))
    by_request: dict[str, list[list]] = {}
    for r in records:
        by_request.setdefault(r[1], []).append(r)
    transition_ticks = {t for _, tick, _ in transitions for t in (tick - 3, tick)}
    steady = [
        (b[5] - a[5]) * 1000.0
        for rs in by_request.values()
        for a, b in zip(rs, rs[1:])
        if b[0] == a[0] + 1 and b[0] not in transition_ticks
    ]
    step_ms = statistics.median(steady)
    rows = []
    for epoch, (name, tick, groups) in enumerate(transitions, start=1):

        def phase(kind: str) -> float:
            return max(a[5] for rep in reports for a in rep["acks"] if a[1] == kind and a[2] == epoch and a[3])

        gaps = [(b[5] - a[5]) * 1000.0 for rs in by_request.values() for a, b in zip(rs, rs[1:]) if a[0] < tick <= b[0]]
        prepare_ms, commit_ms = phase("prepare"), phase("commit")
        # The part of prepare that stops a group (the prepare step; pre-copy then runs between steps).
        steps = [p[2] for rep in reports for p in rep.get("prepare_steps", []) if p[1] == epoch]
        base = restart[groups[0][1]]
        # The slowest worker's commit, phase by phase (cumulative ms): where the pause went.
        timings = [t for rep in reports for e, t in rep.get("commit_timings", []) if e == epoch and t]
        slowest = max(timings, key=lambda t: max(t.values()), default={})
        rows.append(
            {
                "transition": f"{name} -> {_describe(groups)}",
                "prepare_ms": prepare_ms,
                "pause_ms": commit_ms,
                "prepare_step_ms": max(steps) if steps else prepare_ms,
                "total_ms": prepare_ms + commit_ms,
                "stream_gap_ms": max(gaps) if gaps else float("nan"),
                "streams_across": len(gaps),
                "restart_ms": base,
                "speedup": base / (prepare_ms + commit_ms),
                "gap_in_steps": (max(gaps) / step_ms) if gaps else float("nan"),
                "commit_phases_ms": slowest,
            }
        )

    print(
        f"nitsum bench reconfigure: {args.workers} CPU workers, {args.requests} greedy requests, "
        f"{platform.machine()} {os.cpu_count()} cores; steady decode step (median token gap) {step_ms:.2f} ms"
    )
    print(
        "| transition | prepare ms (of it: the step) | pause (commit) ms | total ms | max stream gap ms (steps) "
        "| restart+reload ms | speedup |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['transition']} | {r['prepare_ms']:.1f} ({r['prepare_step_ms']:.1f}) | {r['pause_ms']:.1f} | {r['total_ms']:.1f} | "
            f"{r['stream_gap_ms']:.1f} ({r['gap_in_steps']:.1f}) | {r['restart_ms']:.0f} | {r['speedup']:.0f}x |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"step_ms": step_ms, "rows": rows, "restart_ms": restart}, indent=2))
    return 0
