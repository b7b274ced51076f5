"""`nitsum bench policy --live` (phased): the simulator's phased workload on a live 2-worker node world.

The phases of `nitsum sim tiers` (surge, batch, mixed, surge2: nitsum.sim.experiments.tiers.PHASES; interactive
lengths from the Azure code trace, background from ServeGen) with each phase `--phase-s` long, replayed against
`nitsum up --devices 2 --policy P` for every static layout a node world runs (2 x TP1, TP2, TP1 prefill + TP1
decode) and adaptive, one after another in the same run; each replay starts once the coordinator reports the
policy's layout, roles included. Rules, fixed in docs/BENCHMARKS.md before any run:
- rates: the phases' rates times `load_scale` of the live node (its prefill capacity over the simulated
  H100 node's, from the step table), as `nitsum sim tiers --device-table` scales them, times `--rate-scale`
  (default 1: an overload run states its factor before it runs);
- lengths: prompts capped at `--max-prompt-tokens`, outputs at `--max-output-tokens` (the tiny model's context);
- SLO targets (`derive_targets`): each tier's targets of the tier table times the ratio of the live node's
  profiled step time to the simulated node's (TTFT: prefill of a capped-length prompt at each node's fastest TP;
  TPOT: a decode step of 16 sequences of 1024 tokens), the same for every policy.
Reported per policy: per-tier and per-phase goodput, weighted goodput, the layouts taken over time (polled
from the coordinator every 0.5 s; a plot), and the per-phase oracle: each phase's best static layout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path

# Every static layout a 2-device node world runs (baselines.static_layouts(2, (1, 2))): 2 x TP1 hybrid, TP2
# hybrid, and the P/D split (`disagg` on 2 devices: [0 TP1 prefill][1 TP1 decode]). `static-hybrid` is left
# out: on 2 devices both its lanes are TP1 hybrid, static-tp:1's layout with the same routing.
STATIC_LIVE = ("static-tp:1", "static-tp:2", "disagg")
DEVICES = 2
DECODE_BATCH, DECODE_CONTEXT = 16, 1024
POLL_S = 0.5


def _costs(device_table: str | None):
    from nitsum.policy.steptable import load_step_rows
    from nitsum.sim.cluster import ClusterConfig
    from nitsum_services.coordinator.steps import committed_cpu_rows

    rows = load_step_rows(device_table) if device_table else committed_cpu_rows()
    live = ClusterConfig(model="tiny", device_kind="cpu", device_table=rows, devices_per_node=2, max_tp=2)
    return live, ClusterConfig()


def derive_targets(live_config, ref_config, prompt_tokens: int) -> dict[str, tuple[float, float, float]]:
    """{tier: (ttft_ms, tpot_ms, weight)}: the tier table's targets scaled by live / simulated step times."""
    from nitsum.policy.tiers import DEFAULT_TIERS

    def fastest(config, fn) -> float:
        cost = config.cost_model()
        levels = [k for k in (1, 2, 4, 8) if k <= min(config.devices_per_node, config.max_tp) and cost.fits(k)]
        return min(fn(cost, k) for k in levels)

    def prefill(c, k):
        return c.prefill_time_ms(k, prompt_tokens)

    def decode(c, k):
        return c.decode_step_ms(k, DECODE_BATCH, DECODE_BATCH * DECODE_CONTEXT)

    s_ttft = fastest(live_config, prefill) / fastest(ref_config, prefill)
    s_tpot = fastest(live_config, decode) / fastest(ref_config, decode)
    return {n: (t.ttft_ms * s_ttft, t.tpot_ms * s_tpot, t.weight) for n, t in DEFAULT_TIERS.items()}


def build(args) -> tuple[list, list[tuple[str, float, float]], dict]:
    """(request specs, phase bounds in ms, what the rules gave)."""
    from nitsum.sim.experiments.tiers import PHASES, load_scale, phased_workload
    from nitsum.workloads import phase_bounds
    from nitsum_load.client import RequestSpec

    live, ref = _costs(args.device_table)
    scale = load_scale(live)
    factor = scale * args.rate_scale
    phases = tuple(dataclasses.replace(p, duration_s=args.phase_s, rate_per_s=p.rate_per_s * factor) for p in PHASES)
    reqs, _paths = phased_workload(phases, args.seed)
    targets = derive_targets(live, ref, args.max_prompt_tokens)
    specs = []
    for i, r in enumerate(reqs):
        ttft, tpot, weight = targets[r.tier]
        specs.append(
            RequestSpec(
                f"req-{i:05d}",
                r.arrival_ms,
                min(r.prompt_tokens, args.max_prompt_tokens),
                min(r.output_tokens, args.max_output_tokens),
                r.tier,
                ttft,
                tpot,
                weight,
            )
        )
    rules = {
        "load_scale": scale,
        "rate_scale": args.rate_scale,
        "phases": [dataclasses.asdict(p) for p in phases],
        "targets": {t: {"ttft_ms": v[0], "tpot_ms": v[1], "weight": v[2]} for t, v in targets.items()},
    }
    return specs, phase_bounds(phases), rules


def fixed_layout(policy: str, devices: int = DEVICES) -> str | None:
    """The layout a static policy keeps on a node world of `devices` (its topology's notation, roles included);
    None for adaptive, whose layout is whatever it decides."""
    from nitsum.policy.registry import make_policy
    from nitsum.policy.snapshot import NodeView

    if not is_static(policy):
        return None
    return str(make_policy(policy).initial_topology(NodeView("node0", devices, 1, min(devices, 2), ())))


def reported_layout(status: dict) -> str:
    """The node's layout as the coordinator reports it: its ready groups (leaders) by first device, each with the
    role every one of its members reports ('' while a worker is not ready or a group's members disagree)."""
    workers = status.get("workers", [])
    if not workers or any(w.get("state") != "ready" for w in workers):
        return ""
    parts = []
    for lead in sorted((w for w in workers if w.get("leader")), key=lambda w: w["device_index"]):
        start, tp, role = lead["device_index"], lead["tp"], lead["role"]
        members = [w for w in workers if start <= w["device_index"] < start + tp]
        if len(members) != tp or any(
            (w["tp"], w["role"], w["group_id"]) != (tp, role, lead["group_id"]) for w in members
        ):
            return ""
        parts.append(f"[{start if tp == 1 else f'{start}-{start + tp - 1}'} TP{tp} {role}]")
    return "".join(parts)


def layout_of(status: dict) -> str:
    groups = sorted(status.get("groups", []), key=lambda g: g.get("group_id", ""))
    return "+".join(f"TP{g['tp']}" + ("" if g.get("role") == "hybrid" else g.get("role", "")[:1]) for g in groups)


async def _replay(mesh, specs, policy: str) -> tuple[list, float, list[tuple[float, str]]]:
    from nitsum_load.bench_policy_live import SHAPE_TIMEOUT_S, replay_client_config
    from nitsum_load.bench_reconfigure import admin_call
    from nitsum_load.runner import run_open_loop

    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHAPE_TIMEOUT_S
    want = fixed_layout(policy)
    while want is not None and (got := reported_layout(await admin_call(mesh.nats_url, "status", {}, 5.0))) != want:
        if loop.time() > deadline:
            raise RuntimeError(
                f"{policy}: the coordinator reports {got or 'no settled layout'}, not {want}, after {SHAPE_TIMEOUT_S} s"
            )
        await asyncio.sleep(0.2)
    cfg = await replay_client_config(mesh.url)
    layouts: list[tuple[float, str]] = []
    done = asyncio.Event()
    t0 = time.monotonic()

    async def poll() -> None:
        while not done.is_set():
            try:
                layouts.append((time.monotonic() - t0, layout_of(await admin_call(mesh.nats_url, "status", {}, 2.0))))
            except Exception:  # noqa: BLE001 -- a missed poll leaves a gap in the plot, nothing else
                pass
            await asyncio.sleep(POLL_S)

    poller = asyncio.ensure_future(poll())
    try:
        result = await run_open_loop(specs, cfg, drain_timeout_s=120.0)
    finally:
        done.set()
        await poller
    return result.trackers, result.elapsed_s, layouts


def per_phase(records, bounds) -> dict[str, dict]:
    from nitsum.metrics import summarize

    out = {}
    for name, start, end in bounds:
        mine = [r for r in records if start <= r.send_ms < end]
        rep = summarize(mine, duration_s=(end - start) / 1000.0).to_dict()
        out[name] = {"weighted_goodput_rps": rep["overall"]["weighted_goodput_rps"], "tiers": rep["tiers"]}
    return out


def is_static(policy: str) -> bool:
    """Every policy but adaptive keeps one layout: the best static layout and the oracle choose among these."""
    return policy.strip().lower() != "adaptive"


def oracle(results: dict[str, dict], bounds) -> dict:
    """Each phase's best static layout (by weighted goodput), switched between phases for free."""
    best, total = {}, 0.0
    for name, start, end in bounds:
        cands = {p: r["phases"][name]["weighted_goodput_rps"] or 0.0 for p, r in results.items() if is_static(p)}
        if not cands:
            continue
        winner = max(cands, key=cands.get)
        best[name] = winner
        total += cands[winner] * (end - start)
    span = sum(e - s for _, s, e in bounds)
    return {"per_phase": best, "weighted_goodput_rps": total / span if span else None}


def plot_layouts(results: dict[str, dict], path: Path, bounds=()) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = sorted({lay for r in results.values() for _, lay in r["layouts"]})
    fig, ax = plt.subplots(figsize=(9, 3))
    for i, (policy, r) in enumerate(results.items()):
        ts = [t for t, _ in r["layouts"]]
        lift = 0.06 * (i - (len(results) - 1) / 2)  # policies on one layout draw side by side, not over each other
        ax.step(ts, [names.index(lay) + lift for _, lay in r["layouts"]], where="post", label=policy)
    for name, start, _end in bounds:
        ax.axvline(start / 1000.0, color="grey", linewidth=0.5)
        ax.text(start / 1000.0, len(names) - 0.95, f" {name}", fontsize=8, color="grey")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds into the replay")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def run(args, out: Path) -> dict:
    from nitsum.metrics import summarize
    from nitsum.natsserver import NatsServer
    from nitsum_load.bench_reconfigure import free_port, make_model, remove_weight_store, start_live_mesh
    from nitsum_load.report import write_all

    specs, bounds, rules = build(args)
    policies = [p for p in args.policies.split(",") if p]
    results: dict[str, dict] = {}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nitsum-bench-phased-") as tmp:
        model_dir = make_model("tiny", Path(tmp))
        nats = NatsServer(port=free_port(), config_path=None).start(log_path=out / "logs" / "nats-server.log")
        try:
            for pol in policies:
                name = pol.replace(":", "-")
                print(f"[{pol}] nitsum up --devices 2 --policy {pol}; replaying {len(specs)} requests ...", flush=True)
                env = {"NITSUM_RECONFIG_INTERVAL_MS": str(args.reconfig_interval_ms), "NITSUM_MAX_TP": "2"}
                if args.device_table:
                    env["NITSUM_DEVICE_TABLE"] = str(Path(args.device_table).resolve())
                mesh = start_live_mesh(
                    out / "logs" / name, model_dir=model_dir, nats_url=nats.url, devices=2, policy=pol, env_extra=env
                )
                load_before = os.getloadavg()[0]
                try:
                    trackers, elapsed_s, layouts = asyncio.run(_replay(mesh, specs, pol))
                finally:
                    mesh.stop()
                load_after = os.getloadavg()[0]  # the 1-min load average: a shared machine's other jobs show here
                records = [t.to_record() for t in trackers]
                report = summarize(records, duration_s=sum(e - s for _, s, e in bounds) / 1000.0)
                write_all(report, records, out / name, {"policy": pol, "elapsed_s": elapsed_s})
                d = report.to_dict()
                results[pol] = {
                    "tiers": d["tiers"],
                    "overall": d["overall"],
                    "phases": per_phase(records, bounds),
                    "layout": fixed_layout(pol),  # the one a static policy keeps (None: adaptive)
                    "layouts": layouts,
                    "changes": sum(1 for a, b in zip(layouts, layouts[1:]) if a[1] != b[1]),
                    "load_average": [round(load_before, 2), round(load_after, 2)],
                }
                print(f"[{pol}] done in {elapsed_s:.0f} s: {results[pol]['changes']} layout changes", flush=True)
        finally:
            nats.stop()
            remove_weight_store(model_dir)
    statics = {p: r["overall"]["weighted_goodput_rps"] or 0.0 for p, r in results.items() if is_static(p)}
    best_static = max(statics, key=statics.get) if statics else None
    adaptive = results.get("adaptive", {}).get("overall", {}).get("weighted_goodput_rps")
    report = {
        "mode": "live-phased",
        "rules": rules,
        "requests": len(specs),
        "policies": results,
        "best_static": best_static,
        "oracle": oracle(results, bounds),
        "adaptive_vs_best_static": (adaptive / statics[best_static])
        if adaptive and best_static and statics[best_static]
        else None,
    }
    plotted = plot_layouts(results, out / "layouts_over_time.png", bounds)
    report["plot"] = "layouts_over_time.png" if plotted else None
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def format_table(report: dict) -> str:
    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    tiers = list(report["rules"]["targets"])
    head = " | ".join(f"{t} goodput req/s" for t in tiers)
    lines = [
        f"| policy | weighted goodput | {head} | weighted goodput per phase | layout changes | load avg before/after |"
    ]
    lines.append("|---|---|" + "---|" * len(tiers) + "---|---|---|")
    for pol, r in report["policies"].items():
        cells = " | ".join(f(r["tiers"].get(t, {}).get("goodput_rps")) for t in tiers)
        phases = ", ".join(f"{n} {f(p['weighted_goodput_rps'], '.2f')}" for n, p in r["phases"].items())
        load = "/".join(str(x) for x in r.get("load_average", []))
        lines.append(
            f"| {' '.join(filter(None, (pol, r.get('layout'))))} | {f(r['overall']['weighted_goodput_rps'])} | {cells} | {phases} "
            f"| {r['changes']} | {load} |"
        )
    o = report["oracle"]
    lines.append(
        f"\nper-phase oracle {f(o['weighted_goodput_rps'])} ({o['per_phase']}); best static {report['best_static']}; "
        f"adaptive / best static {f(report['adaptive_vs_best_static'], '.2f')}x (goal >= 1.3x)"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="nitsum bench policy --live", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=15.0, help="length of each of the 4 phases (default 15 s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--policies", default=",".join((*STATIC_LIVE, "adaptive")), help="comma-separated, in this order")
    p.add_argument("--device-table", default=None, help="step table (CSV) of this node; default the committed CPU one")
    p.add_argument("--reconfig-interval-ms", type=int, default=500, help="the coordinator's policy epoch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="every phase's rate times this, on top of the node's load scale (default 1; 2 = twice the load)",
    )
    p.add_argument("--out", type=Path, default=None, help="report directory (default runs/policy-phased-<time>)")
    args = p.parse_args(argv)
    if not args.phase_s > 0 or args.max_prompt_tokens < 1 or args.max_output_tokens < 1:
        p.error("need --phase-s > 0 and positive length caps")
    if not args.rate_scale > 0:
        p.error(f"--rate-scale must be > 0, got {args.rate_scale}")
    if args.max_prompt_tokens + args.max_output_tokens > 2048:
        p.error("prompt + output caps exceed the tiny model's context of 2048")
    out = args.out or Path("runs") / time.strftime("policy-phased-%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    try:
        report = run(args, out)
    except RuntimeError as exc:
        print(f"nitsum bench policy --live: {exc} (logs in {out / 'logs'})")
        return 1
    print(format_table(report))
    print(f"report in {out}")
    return 0
