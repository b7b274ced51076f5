"""`nitsum bench policy --live`: per-tier goodput of the adaptive policy against static TP on the live CPU mesh.

The same slice of a real trace (default: the first `--requests` rows of the Azure conversation trace, arrivals
rescaled to `--target-rate`, prompts and outputs capped to what 4 CPU workers sustain, 30 % interactive /
70 % background by a seeded draw) is replayed, one policy after another in the same run, against
`nitsum up --devices 4 --policy P` for P in adaptive, static-tp:1 and static-tp:4 (a fresh mesh each, the same
model, default the ~27M-parameter random Llama so TP changes the step time). static-tp:K moves the node to
TP=K groups at its first policy epoch; the replay starts once the coordinator reports that shape. Every
request carries its tier's SLO in its headers (the tier table, or `--interactive-ttft-ms` /
`--interactive-tpot-ms`). Per policy and tier: requests, SLO attainment, goodput (requests/s meeting both
targets), weighted goodput, TTFT/TPOT p50 and p99, failures, and the topology changes the coordinator made;
the ratios are adaptive / static-tp:1 and adaptive / static-tp:4.

Each policy's `nitsum load`-format report (summary.json, summary.csv, requests.jsonl, plots) goes to
`<out>/<policy>/`; the comparison to `<out>/report.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_POLICIES = ("adaptive", "static-tp:1", "static-tp:4")
SHAPE_TIMEOUT_S = 60.0


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0 (a ratio against nothing is not a number)."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def compare(summaries: dict[str, dict], baselines: tuple[str, ...], subject: str = "adaptive") -> dict:
    """{tier: {baseline: {"goodput": x, "weighted_goodput": y, "attainment": z}}} of subject / baseline."""
    out: dict[str, dict] = {}
    if subject not in summaries:
        return out
    for tier, s in summaries[subject]["tiers"].items():
        for base in baselines:
            b = summaries.get(base, {}).get("tiers", {}).get(tier)
            if b is None:
                continue
            out.setdefault(tier, {})[base] = {
                "goodput": ratio(s["goodput_rps"], b["goodput_rps"]),
                "weighted_goodput": ratio(s["weighted_goodput_rps"], b["weighted_goodput_rps"]),
                "attainment": ratio(s["slo_attainment"], b["slo_attainment"]),
            }
    return out


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(report: dict) -> str:
    lines = [
        "| policy | tier | requests | SLO attainment | goodput req/s | weighted goodput | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | failed | TP changes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, pol in report["policies"].items():
        for tier, s in pol["tiers"].items():
            lines.append(
                f"| {name} | {tier} | {s['requests']} | {_f(s['slo_attainment'])} | {_f(s['goodput_rps'], '.3f')} | "
                f"{_f(s['weighted_goodput_rps'], '.3f')} | {_f(s['ttft_ms'].get('p50'), '.0f')} / "
                f"{_f(s['ttft_ms'].get('p99'), '.0f')} | {_f(s['tpot_ms'].get('p50'), '.1f')} / "
                f"{_f(s['tpot_ms'].get('p99'), '.1f')} | {s['failed'] + s['unfinished']} | {pol['transitions']} |"
            )
    lines.append("")
    lines.append("| tier | adaptive / baseline | goodput | weighted goodput | SLO attainment |")
    lines.append("|---|---|---|---|---|")
    for tier, per in report["ratios"].items():
        for base, r in per.items():
            lines.append(
                f"| {tier} | {base} | {_f(r['goodput'])}x | {_f(r['weighted_goodput'])}x | {_f(r['attainment'])}x |"
            )
    return "\n".join(lines)


def build_specs(args: argparse.Namespace) -> list:
    from nitsum_load.workload import Shaping, read_trace, shape

    reqs = read_trace(args.trace, limit=args.skip + args.requests, seed=args.seed)[args.skip :]
    specs = shape(
        reqs,
        Shaping(
            tier_mix=args.tier_mix,
            target_rate_per_s=args.target_rate,
            max_requests=args.requests,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
            seed=args.seed,
        ),
    )
    if args.interactive_ttft_ms is not None or args.interactive_tpot_ms is not None:
        specs = [
            dataclasses.replace(
                s,
                ttft_slo_ms=args.interactive_ttft_ms or s.ttft_slo_ms,
                tpot_slo_ms=args.interactive_tpot_ms or s.tpot_slo_ms,
            )
            if s.tier == "interactive"
            else s
            for s in specs
        ]
    return specs


def _shape_reached(status: dict, policy: str, devices: int) -> bool:
    if not policy.startswith("static-tp:"):
        return True
    k = int(policy.split(":", 1)[1])
    leaders = [w for w in status.get("workers", []) if w.get("leader")]
    return len(leaders) == devices // k and all(w.get("tp") == k for w in leaders)


async def replay_client_config(url: str):
    """The load client's settings for a replay of token-id prompts against the gateway at `url` (its model)."""
    from nitsum_load.cli import discover_model
    from nitsum_load.client import ClientConfig

    return ClientConfig(
        base_url=url,
        model=await discover_model(url, None),
        endpoint="completions",
        prompt_format="token-ids",
        return_token_ids=True,
        request_timeout_s=300.0,
    )


async def _run_policy(mesh, specs: list, policy: str, devices: int) -> tuple[list, float, list[dict]]:
    from nitsum_load.bench_reconfigure import admin_call
    from nitsum_load.runner import run_open_loop

    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHAPE_TIMEOUT_S
    while not _shape_reached(status := await admin_call(mesh.nats_url, "status", {}, timeout_s=5.0), policy, devices):
        if loop.time() > deadline:
            why = "; ".join(f"{d.get('node_id')}: {d.get('reason')}" for d in status.get("last_decisions", []))
            raise RuntimeError(
                f"{policy}: the coordinator did not reach its shape within {SHAPE_TIMEOUT_S} s "
                f"(its last decisions: {why or 'none'}; last transitions: "
                f"{status.get('transitions', [])[-2:]})"
            )
        await asyncio.sleep(0.2)
    before = len((await admin_call(mesh.nats_url, "status", {}, timeout_s=5.0)).get("transitions", []))
    cfg = await replay_client_config(mesh.url)
    result = await run_open_loop(specs, cfg, drain_timeout_s=180.0)
    status = await admin_call(mesh.nats_url, "status", {}, timeout_s=5.0)
    # The status keeps the last 20 transitions; those made during the replay are the ones after `before`.
    transitions = status.get("transitions", [])[before:]
    return result.trackers, result.elapsed_s, transitions


def main(argv: list[str]) -> int:
    if not any(a == "--trace" or a.startswith("--trace=") for a in argv):
        # The default: the simulator's phased workload on a 2-worker node world (bench_policy_phased.py).
        from nitsum_load.bench_policy_phased import main as phased_main

        return phased_main(argv)
    from nitsum_load.workload import parse_tier_mix

    p = argparse.ArgumentParser(prog="nitsum bench policy --live", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="trace name or path (azure-conv, ...); without it: the phased run")
    p.add_argument("--requests", type=int, default=60, help="rows of the trace replayed (default 60)")
    p.add_argument("--skip", type=int, default=0, help="rows skipped before the slice (default 0)")
    p.add_argument("--target-rate", type=float, default=1.0, help="mean arrival rate, requests/s (default 1.0)")
    p.add_argument("--tier-mix", default="interactive=0.3,background=0.7")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--interactive-ttft-ms", type=float, default=None, help="override the interactive TTFT target")
    p.add_argument("--interactive-tpot-ms", type=float, default=None, help="override the interactive TPOT target")
    p.add_argument("--model", default="mid", help="mid (~27M-param random Llama, default) | tiny | a model directory")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated, run in this order")
    p.add_argument("--reconfig-interval-ms", type=int, default=500, help="the coordinator's policy epoch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="report directory (default runs/policy-live-<time>)")
    args = p.parse_args(argv)
    try:
        args.tier_mix = parse_tier_mix(args.tier_mix)
    except ValueError as exc:
        p.error(str(exc))
    if args.requests < 1 or not args.target_rate > 0 or args.devices < 1:
        p.error("need --requests >= 1, --target-rate > 0 and --devices >= 1")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for pol in policies:
        if pol.startswith("static-tp:"):
            k = pol.split(":", 1)[1]
            if not k.isdigit() or int(k) < 1 or args.devices % int(k):
                p.error(f"--policies: {pol} does not divide {args.devices} devices")
    try:
        specs = build_specs(args)
    except (FileNotFoundError, ValueError) as exc:
        p.error(f"--trace: {exc}")
    if not specs:
        p.error("the trace slice is empty")
    out = args.out or Path("runs") / time.strftime("policy-live-%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)

    from nitsum.metrics import summarize
    from nitsum.natsserver import NatsServer
    from nitsum_load.bench_reconfigure import free_port, make_model, remove_weight_store, start_live_mesh
    from nitsum_load.report import write_all

    summaries: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="nitsum-bench-policy-") as tmp:
        try:
            model_dir = make_model(args.model, Path(tmp))
        except FileNotFoundError as exc:
            p.error(str(exc))
        nats = NatsServer(port=free_port(), config_path=None).start(log_path=out / "logs" / "nats-server.log")
        try:
            for pol in policies:
                name = pol.replace(":", "-")
                print(
                    f"[{pol}] nitsum up --devices {args.devices} --policy {pol}; replaying {len(specs)} requests ...",
                    flush=True,
                )
                mesh = start_live_mesh(
                    out / "logs" / name,
                    model_dir=model_dir,
                    nats_url=nats.url,
                    devices=args.devices,
                    policy=pol,
                    env_extra={"NITSUM_RECONFIG_INTERVAL_MS": str(args.reconfig_interval_ms)},
                )
                try:
                    trackers, elapsed_s, transitions = asyncio.run(_run_policy(mesh, specs, pol, args.devices))
                finally:
                    mesh.stop()
                records = [t.to_record() for t in trackers]
                report = summarize(records)
                write_all(
                    report,
                    records,
                    out / name,
                    {"policy": pol, "elapsed_s": elapsed_s, "transitions": transitions},
                    log_rows=(t.to_log() for t in trackers),
                )
                d = report.to_dict()
                summaries[pol] = {
                    "tiers": d["tiers"],
                    "overall": d["overall"],
                    "duration_s": d["duration_s"],
                    "transitions": len(transitions),
                    "transition_log": transitions,
                }
                print(f"[{pol}] done in {elapsed_s:.0f} s, {len(transitions)} topology changes", flush=True)
        except RuntimeError as exc:
            sys.stderr.write(f"nitsum bench policy --live: {exc}\n(logs in {out / 'logs'})\n")
            return 1
        finally:
            nats.stop()
            remove_weight_store(model_dir)
    baselines = tuple(x for x in policies if x != "adaptive")
    full = {
        "mode": "live",
        "command": "nitsum bench policy --live " + " ".join(argv),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "trace": args.trace,
        "requests": len(specs),
        "target_rate_per_s": args.target_rate,
        "tier_mix": args.tier_mix,
        "model": args.model,
        "devices": args.devices,
        "policies": summaries,
        "ratios": compare(summaries, baselines),
    }
    (out / "report.json").write_text(json.dumps(full, indent=2))
    print(
        f"nitsum bench policy --live: {len(specs)} requests of {args.trace} at {args.target_rate} req/s, "
        f"model {args.model}, {args.devices} CPU workers, {full['machine']}"
    )
    print(format_table(full))
    print(f"report in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
