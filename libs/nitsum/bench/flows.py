"""`nitsum bench flows`: RMLQ decision time per event and testbed TTFT SLO attainment vs the baselines.

Part 1 (always): each scheduler holds `--flows` active flows (mixed stages, 10 per unit); a stream of
events (arrival + completion pairs keeping the count constant, progress, layer boundaries) is timed
one by one; p50/p99 per event in µs and the ratio of RMLQ's p99 to Fair Sharing's, same run.
Part 2 (root + iproute2 only): the namespace testbed (nitsum.transfer.netns) replays one generated
load — tight interactive and loose background requests, each a KV-reuse fetch, prefill layers and a
P2D transfer — under RMLQ, FS, SJF, EDF and Karuna in turn; prints TTFT SLO attainment per tier.
A benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import random
import time

from nitsum.policy.flow_baselines import SCHEDULER_NAMES, make_flow_scheduler
from nitsum.policy.flows import FlowSpec, Stage

_STAGES = (Stage.KV_REUSE, Stage.COLLECTIVE, Stage.P2D, Stage.MIGRATION)


def _flow(rng: random.Random, i: int, unit: int, now_ms: float, num_links: int) -> FlowSpec:
    stage = _STAGES[i % 4]
    explicit = stage.explicit
    deadline = now_ms + rng.uniform(50.0, 5000.0)
    return FlowSpec(
        flow_id=f"f{i}",
        request_id=f"r{i // 2}",
        unit_id=f"u{unit}",
        stage=stage,
        size_bytes=rng.randint(1 << 16, 1 << 26),
        src="a",
        dst="b",
        path=(f"l{rng.randrange(num_links)}", f"l{rng.randrange(num_links)}"),
        target_layer=None if explicit else rng.randint(0, 80),
        deadline_ms=deadline if explicit else None,
        request_deadlines_ms=(deadline, deadline + rng.uniform(0.0, 2000.0)),
    )


def _pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs; NaN when there is none (a short run may draw no event of a kind)."""
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)] if s else float("nan")


def decision_times(name: str, num_flows: int, num_events: int, seed: int) -> dict[str, list[float]]:
    """Per event kind: wall time of each handler call in µs (same seeded event stream for every name)."""
    rng = random.Random(seed)
    sched = make_flow_scheduler(name)
    units = max(num_flows // 10, 1)
    now = 0.0
    active: list[str] = []
    for i in range(num_flows):
        sched.on_arrival(_flow(rng, i, i % units, now, 64), now)
        active.append(f"f{i}")
    remaining = {fid: 1 << 26 for fid in active}
    out: dict[str, list[float]] = {"arrival": [], "complete": [], "progress": [], "layer": []}
    next_id = num_flows
    layer = [0] * units
    clock = time.perf_counter_ns
    for _ in range(num_events):
        now += 0.05
        kind = rng.random()
        if kind < 0.25:
            idx = rng.randrange(len(active))
            fid = active[idx]
            active[idx] = active[-1]
            active.pop()
            remaining.pop(fid, None)
            t = clock()
            sched.on_complete(fid, now)
            out["complete"].append((clock() - t) / 1e3)
            spec = _flow(rng, next_id, rng.randrange(units), now, 64)
            t = clock()
            sched.on_arrival(spec, now)
            out["arrival"].append((clock() - t) / 1e3)
            active.append(spec.flow_id)
            remaining[spec.flow_id] = spec.size_bytes
            next_id += 1
        elif kind < 0.75:
            fid = active[rng.randrange(len(active))]
            st = sched.state(fid)
            left = max((st.remaining_bytes if st else 0) - (1 << 16), 0)
            t = clock()
            sched.on_progress(fid, left, now)
            out["progress"].append((clock() - t) / 1e3)
        else:
            u = rng.randrange(units)
            layer[u] += 1
            t = clock()
            sched.on_layer_boundary(f"u{u}", layer[u], now)
            out["layer"].append((clock() - t) / 1e3)
    return out


def generated_load(
    seed: int,
    num_requests: int,
    rate_mbit: float,
    utilization: float = 0.85,
    mix: str = "aligned",
) -> list[dict[str, object]]:
    """Tight interactive requests (SLO 2× their unloaded time) among loose background ones (SLO 4×).
    `mix` "aligned": every interactive request is a small one (small reuse and P2D), every background one a
    big one -- size and urgency coincide, SJF's best case. "independent": a request's size class (small or
    big, the same two ranges) is drawn apart from its tier, so half the urgent requests are big ones.
    Poisson arrivals offer `utilization` of the link (same mean size either way), so it is contended in
    bursts.
    """
    if mix not in ("aligned", "independent"):
        raise ValueError(f"mix must be 'aligned' or 'independent', got {mix!r}")
    rng = random.Random(seed)
    link_bytes_per_ms = rate_mbit * 1e6 / 8 / 1000.0
    out: list[dict[str, object]] = []
    t_ms = 0.0
    for i in range(num_requests):
        tight = rng.random() < 0.5
        small = tight if mix == "aligned" else rng.random() < 0.5
        reuse = rng.randint(20_000, 60_000) if small else rng.randint(100_000, 300_000)
        p2d = rng.randint(100_000, 250_000) if small else rng.randint(600_000, 1_200_000)
        alone_ms = (reuse + p2d) / link_bytes_per_ms + 40.0
        out.append(
            {
                "id": f"q{i}",
                "tier": "interactive" if tight else "background",
                "arrival_ms": round(t_ms, 3),
                "reuse_bytes": reuse,
                "p2d_bytes": p2d,
                "compute_ms": 40.0,
                "slo_ms": round(alone_ms * (2.0 if tight else 4.0), 3),
            }
        )
        mean_bytes = 0.5 * (40_000 + 175_000) + 0.5 * (200_000 + 900_000)
        t_ms += rng.expovariate(1.0 / (mean_bytes / link_bytes_per_ms / utilization))
    return out


def _testbed(args: argparse.Namespace) -> None:
    from nitsum.transfer import netns

    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"\ntestbed: skipped ({reason})")
        return
    requests = generated_load(args.seed, args.requests, args.rate_mbit, args.utilization, args.mix)
    print(
        f"\ntestbed: {len(requests)} requests ({args.mix} sizes and tiers), veth at {args.rate_mbit} Mbit/s "
        f"(htb, 3 DSCP classes), offered load {args.utilization}, seed {args.seed}, "
        f"RMLQ E={args.rmlq_e} U={args.rmlq_u}, pruning "
        f"{('on, every scheduler' if args.prune_baselines else 'on (RMLQ)') if args.prune else 'off'}"
    )
    print(f"{'scheduler':>10} {'attain all':>10} {'interactive':>11} {'background':>10} {'p50 TTFT ms':>11}")
    base: float | None = None
    with netns.veth_testbed(args.rate_mbit, tag=f"b{__import__('os').getpid()}") as bed:
        for k, name in enumerate(args.schedulers):
            load = {
                "scheduler": name,
                "rate_mbit": args.rate_mbit,
                "layers": 8,
                "requests": requests,
                "rmlq": {"e": args.rmlq_e, "u": args.rmlq_u},
                "prune": args.prune,
                "prune_baselines": args.prune_baselines,
            }
            res = netns.run_plan(bed, load, port=47100 + k, timeout_s=300.0, mode="replay")
            ttft = res["ttft_ms"]
            met = {
                r["id"]: float(ttft[str(r["id"])]) <= float(r["slo_ms"])
                for r in requests  # type: ignore[arg-type]
                if str(r["id"]) in ttft
            }

            def share(tier: str | None) -> float:
                ids = [r["id"] for r in requests if tier is None or r["tier"] == tier]
                return sum(bool(met.get(i)) for i in ids) / max(len(ids), 1)

            allv = share(None)
            if name == "rmlq":
                base = allv
            p50 = _pct([float(v) for v in ttft.values()], 0.5) if ttft else float("nan")  # type: ignore[arg-type]
            print(f"{name:>10} {allv:>10.2f} {share('interactive'):>11.2f} {share('background'):>10.2f} {p50:>11.0f}")
    if base is not None:
        print("(attainment is the share of requests whose TTFT met its SLO; same load, same run)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nitsum bench flows", description=__doc__.splitlines()[0])
    p.add_argument("--flows", type=int, default=10_000, help="active flows held during the timing")
    p.add_argument("--events", type=int, default=20_000, help="timed events per scheduler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=40, help="requests in the testbed load")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="testbed link rate")
    p.add_argument("--utilization", type=float, default=0.85, help="offered load of the testbed link")
    p.add_argument(
        "--mix",
        choices=("aligned", "independent"),
        default="aligned",
        help="testbed load: urgent requests are the small ones (aligned) or sized apart from their tier",
    )
    p.add_argument("--schedulers", nargs="+", default=list(SCHEDULER_NAMES), choices=SCHEDULER_NAMES)
    p.add_argument("--no-testbed", action="store_true", help="decision time only")
    p.add_argument(
        "--prune", action="store_true", help="testbed: RMLQ's overload pruning on (a pruned request is a miss)"
    )
    p.add_argument(
        "--prune-baselines",
        action="store_true",
        help="testbed, with --prune: the baselines run RMLQ's worst-case check and pruning too (the breakdown)",
    )
    p.add_argument("--rmlq-e", type=float, default=4.0, help="RMLQ threshold ratio E (paper: 4)")
    p.add_argument("--rmlq-u", type=float, default=0.5, help="RMLQ threshold scale U (paper: 0.5)")
    args = p.parse_args(argv)
    if args.flows < 10 or args.events < 1:
        p.error("--flows must be >= 10 and --events >= 1")
    if args.prune_baselines and not args.prune:
        p.error("--prune-baselines needs --prune")
    if args.rmlq_e <= 1.0 or args.rmlq_u <= 0.0:
        p.error(f"need --rmlq-e > 1 and --rmlq-u > 0, got E={args.rmlq_e} U={args.rmlq_u}")

    print(f"decision time per event at {args.flows} active flows, {args.events} events, seed {args.seed}")
    print(f"{'scheduler':>10} {'p50 µs':>8} {'p99 µs':>8} {'max µs':>8} {'layer p99':>9} {'arrival p99':>11}")
    p99s: dict[str, float] = {}
    for name in args.schedulers:
        times = decision_times(name, args.flows, args.events, args.seed)
        allt = [x for xs in times.values() for x in xs]
        p99s[name] = _pct(allt, 0.99)
        print(
            f"{name:>10} {_pct(allt, 0.5):>8.1f} {p99s[name]:>8.1f} {max(allt):>8.1f} "
            f"{_pct(times['layer'], 0.99):>9.1f} {_pct(times['arrival'], 0.99):>11.1f}"
        )
    if "rmlq" in p99s and "fs" in p99s:
        print(
            f"rmlq p99 / fs p99 = {p99s['rmlq'] / p99s['fs']:.2f}   (goal: rmlq p99 < 1000 µs: "
            f"{'met' if p99s['rmlq'] < 1000.0 else 'NOT met'})"
        )
    if not args.no_testbed:
        _testbed(args)
    return 0
