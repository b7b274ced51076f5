"""`nitsum sim <experiment> [--out DIR] [--quick] [--seed N] [--device-table FILE] [--phased-seeds N]
[--stationary-seeds N]`: run one experiment, write CSV + PNG + Markdown."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from nitsum.sim.experiments import EXPERIMENTS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nitsum sim", description="cluster simulator experiments")
    p.add_argument("experiment", choices=sorted(EXPERIMENTS), help="which experiment to run")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: runs/sim/<experiment>)")
    p.add_argument("--quick", action="store_true", help="a small version (seconds), for tests and smoke checks")
    p.add_argument("--seed", type=int, default=0, help="workload seed (runs are deterministic for a seed)")
    p.add_argument(
        "--device-table",
        type=Path,
        default=None,
        metavar="FILE",
        help="measured step times (CSV: device,model,tp,phase,batch_size,prompt_tokens,context_tokens,ms; "
        "`nitsum bench profile --csv` writes it): the simulator and the policy price steps from it",
    )
    p.add_argument(
        "--phased-seeds",
        type=int,
        default=None,
        metavar="N",
        help="tiers only: run the phased load on N seeds (--seed onwards) and report each and their mean",
    )
    p.add_argument(
        "--stationary-seeds",
        type=int,
        default=None,
        metavar="N",
        help="tiers only: run the single-node stationary sweep on N seeds (--seed onwards) and report each, "
        "their means and the static layout best for each rate over them",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out if args.out is not None else Path("runs") / "sim" / args.experiment
    module = importlib.import_module(EXPERIMENTS[args.experiment])
    if args.device_table is not None:
        from nitsum.policy.steptable import StepTableError, load_step_rows

        try:
            load_step_rows(args.device_table)
        except StepTableError as exc:
            print(f"nitsum sim: {exc}", file=sys.stderr)
            return 2
    extra = {}
    for flag, key in (("--phased-seeds", "phased_seeds"), ("--stationary-seeds", "stationary_seeds")):
        n = getattr(args, key)
        if n is None:
            continue
        if args.experiment != "tiers":
            print(f"nitsum sim: {flag} is an option of `sim tiers` only", file=sys.stderr)
            return 2
        if n < 1:
            print(f"nitsum sim: {flag} must be >= 1, got {n}", file=sys.stderr)
            return 2
        extra[key] = n
    result = module.run(out, quick=args.quick, seed=args.seed, device_table=args.device_table, **extra)
    print(result.get("speed", ""))
    print(f"wrote {out}/{args.experiment}.csv, .png, .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
