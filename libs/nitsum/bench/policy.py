"""`nitsum bench policy`: how long one policy decision takes (goal: adaptive p99 < 1 ms for an 8-device
node with 1,000 queued requests, ALGORITHMS.md §1.5).

Builds `--snapshots` deterministic snapshots (seeded) of one node whose current topology cycles through
typical layouts, with `--requests` requests (a mix of interactive and background; 1/4 already running on
groups, the rest queued), then times, per snapshot, in this order: adaptive `decide_topology`, the
`static-tp` baseline's `decide_topology` (the same-run baseline the ratio is taken against), adaptive
`route` of one queued request, `admit` of one new request and `shed`. Snapshots are built outside the
timed region; their lazy indexes are built inside it (the coordinator pays for them too).

This harness reads the clock (perf_counter_ns); the policy objects it times never do.

`--live` runs the other half instead: the simulator's phased workload on a live 2-worker node world, every
static layout it runs and adaptive in one run, per-tier and per-phase goodput, the layouts over time and the
per-phase oracle (`load/bench_policy_phased.py`; `--live --trace NAME` replays a trace slice against
`static-tp:1`, `static-tp:4` and adaptive instead, `load/bench_policy_live.py`; see `--live --help`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from nitsum.policy.base import PolicyConfig
from nitsum.policy.costmodel import DEVICE_PRESETS, MODEL_PRESETS, model_spec
from nitsum.policy.registry import make_policy
from nitsum.policy.snapshot import ClusterSnapshot, GroupView, NodeView, RequestView, group_id_of
from nitsum.topology import Topology

LAYOUTS_8 = (
    "[0-7 TP8 hybrid]",
    "[0-3 TP4 hybrid][4-7 TP4 hybrid]",
    "[0-1 TP2 hybrid][2-3 TP2 hybrid][4-5 TP2 hybrid][6-7 TP2 hybrid]",
    "[0-3 TP4 hybrid][4-5 TP2 hybrid][6-7 TP2 hybrid]",
    "[0-3 TP4 prefill][4-5 TP2 decode][6-7 TP2 decode]",
)


def _layouts(num_devices: int, min_tp: int) -> list[Topology]:
    if num_devices == 8 and min_tp <= 2:
        return [Topology.parse(t) for t in LAYOUTS_8]
    levels = [k for k in (1, 2, 4, 8, 16) if min_tp <= k <= num_devices and num_devices % k == 0]
    return [Topology.uniform(num_devices, k) for k in levels]


def build_snapshot(
    rng: random.Random, top: Topology, num_devices: int, min_tp: int, device: str, num_requests: int, now_ms: float
) -> ClusterSnapshot:
    groups = tuple(GroupView(group_id_of("n0", g.start, g.tp), g.devices, g.tp, g.role) for g in top.groups)
    node = NodeView("n0", num_devices, min_tp, num_devices, groups, device, None)
    reqs = []
    decode_groups = [g for g in groups if g.role != "prefill"] or list(groups)
    for i in range(num_requests):
        interactive = rng.random() < 0.3
        tier, ttft, tpot, w = (
            ("interactive", 200.0, 25.0, 10.0) if interactive else ("background", 10_000.0, 100.0, 1.0)
        )
        prompt = int(rng.lognormvariate(6.5, 0.8)) + 16
        out = int(rng.lognormvariate(4.5, 0.8)) + 2
        age = rng.uniform(0, ttft * 0.8)
        if rng.random() < 0.25:  # running on a group
            g = decode_groups[rng.randrange(len(decode_groups))]
            done = rng.randrange(1, out)
            reqs.append(
                RequestView(
                    f"r{i}", tier, ttft, tpot, w, now_ms - age - 1000.0, prompt, out, done, now_ms - age, g.group_id
                )
            )
        else:
            reqs.append(RequestView(f"r{i}", tier, ttft, tpot, w, now_ms - age, prompt, out))
    return ClusterSnapshot(now_ms, (node,), tuple(reqs), epoch=0)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--live" in argv:
        # Imported only here: the decision-latency half stays standard-library only.
        from nitsum_load.bench_policy_live import main as live_main

        return live_main([a for a in argv if a != "--live"])
    ap = argparse.ArgumentParser(prog="nitsum bench policy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests in each snapshot (default 1000)")
    ap.add_argument("--devices", type=int, default=8, help="devices in the node (default 8)")
    ap.add_argument("--min-tp", type=int, default=1)
    ap.add_argument("--snapshots", type=int, default=300, help="timed decisions per policy (default 300)")
    ap.add_argument("--model", default="llama-3-70b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--device", default="h100", choices=sorted(DEVICE_PRESETS) + ["cpu"])
    ap.add_argument("--baseline", default="static-tp:2", help="policy spec timed alongside (default static-tp:2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--live", action="store_true", help="live-mesh goodput comparison instead (see above)")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.snapshots < 1 or args.devices < 1:
        ap.error("--requests, --snapshots and --devices must be >= 1")
    if args.devices & (args.devices - 1):
        ap.error("--devices must be a power of two")

    cfg = PolicyConfig(model=model_spec(args.model), min_dwell_ms=0.0)
    adaptive = make_policy("adaptive", cfg)
    try:
        baseline = make_policy(args.baseline, cfg)
    except ValueError as e:
        ap.error(str(e))
    rng = random.Random(args.seed)
    layouts = _layouts(args.devices, args.min_tp)
    try:
        base_top = baseline.initial_topology(
            build_snapshot(rng, layouts[0], args.devices, args.min_tp, args.device, 1, 0.0).nodes[0]
        )
    except ValueError as e:
        ap.error(str(e))
    new_req = RequestView("new", "interactive", 200.0, 25.0, 10.0, 0.0, 800, 100)

    def timed(fn) -> float:
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e6

    results: dict[str, list[float]] = {k: [] for k in ("adaptive", "baseline", "route", "admit", "shed")}
    paths: dict[str, int] = {}
    changes = 0
    cold_ms = 0.0
    for i in range(args.snapshots):
        # Built right before it is used, as the coordinator does (untimed).
        now = 1e6 + 1000.0 * i
        s = build_snapshot(rng, layouts[i % len(layouts)], args.devices, args.min_tp, args.device, args.requests, now)
        b = build_snapshot(rng, base_top, args.devices, args.min_tp, args.device, args.requests, now)
        holder = {}
        results["adaptive"].append(timed(lambda: holder.setdefault("d", adaptive.decide_topology(s))))
        if i == 0:
            cold_ms = results["adaptive"][0]
        d = holder["d"][0]
        paths[d.path] = paths.get(d.path, 0) + 1
        changes += d.target is not None
        results["baseline"].append(timed(lambda: baseline.decide_topology(b)))
        queued = next(r for r in s.requests if r.group_id is None)
        results["route"].append(timed(lambda: adaptive.route(s, queued)))
        results["admit"].append(timed(lambda: adaptive.admit(s, new_req)))
        results["shed"].append(timed(lambda: adaptive.shed(s)))

    out = sys.stdout
    out.write(
        f"nitsum bench policy: {args.devices} devices, {args.requests} requests/snapshot, "
        f"{args.snapshots} snapshots, model {args.model}, device {args.device}, seed {args.seed}\n"
    )
    out.write(f"{'call':<28}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}\n")
    labels = {
        "adaptive": "adaptive decide_topology",
        "baseline": f"{baseline.name} decide_topology",
        "route": "adaptive route (1 request)",
        "admit": "adaptive admit (1 request)",
        "shed": "adaptive shed",
    }
    for key, label in labels.items():
        xs = results[key]
        out.write(f"{label:<28}{_pct(xs, 0.5):>10.3f}{_pct(xs, 0.99):>10.3f}{max(xs):>10.3f}\n")
    a50, a99 = _pct(results["adaptive"], 0.5), _pct(results["adaptive"], 0.99)
    b50 = _pct(results["baseline"], 0.5)
    out.write(f"first (cold-memo) adaptive decision: {cold_ms:.3f} ms\n")
    out.write(
        f"adaptive/baseline p50 ratio: {a50 / b50:.1f}x; adaptive p99 / 1 ms goal: {a99:.3f}"
        f" ({'meets' if a99 < 1.0 else 'MISSES'} the goal)\n"
    )
    out.write(
        f"decision paths: {', '.join(f'{k}={v}' for k, v in sorted(paths.items()))}; "
        f"topology changes proposed: {changes}/{args.snapshots}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
