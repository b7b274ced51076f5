"""`nitsum bench profile`: measure the live engine on this CPU and fit the cost model's CPU device table.

The engine runs as a worker runs it (one torch thread by default, fp32, prefix caching off so that every
repeat computes). For each grid point a batch of requests is placed in the engine and `engine.step()` is
timed with the batch in a known state:
- decode (batch B, context L per sequence): B prompts of L tokens are prefilled untimed, then decode steps
  of B tokens are timed; the context of a step is the tokens its sequences attend to, summed.
- prefill (batch B, n tokens each): B fresh prompts of n tokens, `max_tokens=1`, all in one step.
A point's time is the fastest of its timed steps: other processes on the machine only ever add time, and
the table describes the device, not its neighbours. Every timed step is checked to have done what was planned (tokens computed, outputs returned), so a
scheduler change cannot silently turn a decode point into something else.

The fit (`fit_roofline`, pure) follows `CostModel.step_time_ms` at TP=1:
    step_ms = max(flops · a, bytes · b) + c + d · batch + e · [the step computes prompt tokens]
with the FLOPs and bytes of each point taken from the cost model itself (so the table is fitted to the
formulas it will be used with), a = 1e3 / effective FLOP/s, b = 1e3 / effective bytes/s, c = step_overhead_ms,
d = seq_overhead_ms (Python work per sequence: scheduling, sampling, detokenising) and e =
prefill_step_overhead_ms (a prefill step's extra fixed cost). It minimises the squared *relative* error (alternating between the points' current
bound and a non-negative least squares of the coefficients, from several starts). A term that bounds no
point is not identified by the data, only bounded: the fit uses the slowest value still consistent with
every point (it then binds exactly at the tightest one), the table the measured peak when that is faster
(still consistent), and the report flags it "bound only".

Peak FLOP/s and memory bandwidth are measured separately (a large matmul, a large copy, best of several),
so the efficiencies written are measured ratios: fitted effective rate / peak. Fields the profile does not
measure (link bandwidth, collective latency, memory size, reserve) are carried over from the table it
replaces. The fit quality is reported as predicted vs measured per point and the mean absolute percentage
error, next to the MAPE of the table being replaced on the same measurements.

Layout: profile_fit.py (the fit, pure), profile_measure.py (the measurements); this module is the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from nitsum.bench.profile_fit import (
    RooflineFit,
    StepPoint,
    fit_roofline,
    fitted_device,
    format_report,
    mean_abs_pct_error,
    predict_ms,
    roofline_terms,
    table_json,
)
from nitsum.bench.profile_measure import (
    FULL_DECODE_GRID,
    FULL_PREFILL_GRID,
    QUICK_DECODE_GRID,
    QUICK_PREFILL_GRID,
    Profiler,
    _cpu_name,
    _rank_main,
    csv_rows,
    engine_config,
    measure_peaks,
    measure_points,
    model_spec_of,
    profile_tp,
)
from nitsum.policy.costmodel import CostModel, DeviceSpec, load_device_table

__all__ = [
    "DEFAULT_TABLE_PATH",
    "FULL_DECODE_GRID",
    "FULL_PREFILL_GRID",
    "QUICK_DECODE_GRID",
    "QUICK_PREFILL_GRID",
    "Profiler",
    "RooflineFit",
    "StepPoint",
    "csv_rows",
    "engine_config",
    "fit_roofline",
    "fitted_device",
    "format_report",
    "main",
    "mean_abs_pct_error",
    "measure_peaks",
    "measure_points",
    "model_spec_of",
    "predict_ms",
    "profile_tp",
    "roofline_terms",
    "table_json",
]

DEFAULT_TABLE_PATH = Path(__file__).resolve().parents[1] / "data" / "costmodel" / "cpu.json"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nitsum bench profile", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: the tiny checkpoint, made in a temp dir)"
    )
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds; used by the tests)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the workers run)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per point (default 12; --quick 5)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed prefill steps per point (default 7; --quick 3)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the device table (JSON) here")
    parser.add_argument(
        "--tp",
        default="1",
        help="TP levels to measure, comma-separated powers of two (default 1; "
        "each level > 1 runs that many rank processes in a node world)",
    )
    parser.add_argument(
        "--csv",
        type=Path,
        default=None,
        help="write every measured step as a step table (CSV: "
        "device,model,tp,phase,batch_size,prompt_tokens,context_tokens,ms; `nitsum sim --device-table`)",
    )
    parser.add_argument(
        "--from-vidur",
        type=Path,
        default=None,
        metavar="MLP_CSV",
        help="measure nothing: build the --csv step table from a Vidur GPU profile (its mlp.csv, with "
        "--all-reduce; docs/SIMULATOR.md)",
    )
    parser.add_argument("--all-reduce", type=Path, default=None, help="with --from-vidur: Vidur's all_reduce.csv")
    parser.add_argument(
        "--device-kind", default="h100", help="with --from-vidur: the device preset of the profile (default h100)"
    )
    parser.add_argument(
        "--preset",
        default="llama-3-70b",
        help="with --from-vidur: the model preset it prices (default llama-3-70b; --model DIR instead: that "
        "checkpoint, its rows named by the directory, as NITSUM_DEVICE_TABLE looks them up)",
    )
    parser.add_argument("--rank-of-world", default=None, help=argparse.SUPPRESS)  # internal: one rank of a TP>1 profile
    parser.add_argument(
        "--write-default",
        action="store_true",
        help=f"write the device table to the shipped {DEFAULT_TABLE_PATH.relative_to(DEFAULT_TABLE_PATH.parents[3])}",
    )
    args = parser.parse_args(argv)
    if args.from_vidur is not None:
        return _from_vidur(parser, args)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there")
    steps = args.steps or (5 if args.quick else 12)
    repeats = args.repeats or (3 if args.quick else 7)
    if steps < 1 or repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    if args.rank_of_world is not None:
        args.steps, args.repeats = steps, repeats
        return _rank_main(json.loads(args.rank_of_world), args)
    try:
        tp_levels = sorted({int(x) for x in args.tp.split(",") if x.strip()})
    except ValueError:
        parser.error(f"--tp {args.tp!r}: expected comma-separated integers")
    if not tp_levels or any(k < 1 or k & (k - 1) for k in tp_levels):
        parser.error(f"--tp {args.tp!r}: every level must be a power of two >= 1")

    import torch

    torch.set_num_threads(args.threads)
    decode_grid = QUICK_DECODE_GRID if args.quick else FULL_DECODE_GRID
    prefill_grid = QUICK_PREFILL_GRID if args.quick else FULL_PREFILL_GRID
    max_batched = max(b * n for b, n in prefill_grid)
    kv_tokens = max(b * (ctx + steps + 8) for b, ctx in decode_grid) + max_batched
    with tempfile.TemporaryDirectory(prefix="nitsum-profile-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from nitsum.model.tiny import make_tiny

            model_dir = make_tiny(Path(tmp) / "tiny")
        spec = model_spec_of(model_dir)
        kv_cache_mb = max(16, math.ceil(kv_tokens * spec.kv_bytes_per_token * 1.25 / 2**20))
        print(
            f"profiling {spec.name} on {_cpu_name()}, {args.threads} torch thread(s): "
            f"{len(decode_grid)} decode + {len(prefill_grid)} prefill points...",
            flush=True,
        )
        profiler = Profiler(model_dir, max_batched, kv_cache_mb, args.seed)
        points = measure_points(profiler, decode_grid, prefill_grid, steps, repeats)
        peak_flops, peak_bytes = measure_peaks(torch)
        table_rows = csv_rows(points, 1, "cpu", spec.name)
        for tp in tp_levels:
            if tp > 1:
                print(f"profiling TP{tp} ({tp} rank processes in a node world)...", flush=True)
                tp_points = profile_tp(
                    model_dir, tp, args.quick, args.threads, steps, repeats, args.seed, max_batched, kv_cache_mb
                )
                table_rows += csv_rows(tp_points, tp, "cpu", spec.name)
        if 1 not in tp_levels:
            table_rows = [r for r in table_rows if r.tp != 1]

    terms = [roofline_terms(spec, p) for p in points]
    flops, num_bytes = [t[0] for t in terms], [t[1] for t in terms]
    measured = [p.step_ms for p in points]
    batches, prefills = [p.batch_size for p in points], [p.kind == "prefill" for p in points]
    fit = fit_roofline(flops, num_bytes, measured, batches, prefills)
    predicted = [predict_ms(fit, f, x, bs, pf) for f, x, bs, pf in zip(flops, num_bytes, batches, prefills)]
    base = load_device_table(None)  # the shipped table: its unmeasured fields carry over
    baseline = [CostModel(spec, base).step_time_ms(1, p.batch_size, p.num_tokens, p.context_tokens) for p in points]

    command = "nitsum bench profile " + " ".join(argv) if argv else "nitsum bench profile"
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    source = (
        f"measured {when} by `{command}` on {_cpu_name()} ({os.cpu_count()} cores visible, {args.threads} torch thread(s), "
        f"torch {torch.__version__}, fp32, model {spec.name}); peak FLOP/s and bandwidth from a 512^3 matmul and a 64 MiB copy; "
        f"link/collective/memory fields carried over from the previous table"
    )
    device = fitted_device(base, fit, peak_flops, peak_bytes, source)
    text = table_json(device, points, predicted, fit, command)
    assert DeviceSpec.from_json(text) == device, "the written table must load back as the fitted device"

    print(format_report(points, predicted, baseline))
    base_name = "placeholder" if base.placeholder else "previous"
    print(f"\nmeasured peaks: {peak_flops / 1e9:.1f} GFLOP/s (512^3 matmul), {peak_bytes / 1e9:.1f} GB/s (64 MiB copy)")
    print(
        f"table: {device.peak_flops * device.compute_efficiency / 1e9:.2f} GFLOP/s effective "
        f"(efficiency {device.compute_efficiency:.2f}){'' if fit.compute_identified else ' [bound only: no point compute-bound]'}, "
        f"{device.mem_bandwidth_bytes_per_s * device.memory_efficiency / 1e9:.2f} GB/s effective "
        f"(efficiency {device.memory_efficiency:.2f}){'' if fit.memory_identified else ' [bound only: no point memory-bound]'}, "
        f"step overhead {fit.step_overhead_ms:.3f} ms + {fit.ms_per_seq:.4f} ms per sequence + "
        f"{fit.prefill_step_ms:.3f} ms per prefill step"
    )
    print(
        f"mean absolute percentage error: fitted {100 * fit.mean_abs_pct_error:.1f}% vs {base_name} table "
        f"{100 * mean_abs_pct_error(baseline, measured):.1f}% on the same {len(points)} measurements"
    )
    print(text, end="")
    if args.csv is not None:
        from nitsum.policy.steptable import parse_rows, write_rows

        csv_text = write_rows(table_rows)
        parse_rows(csv_text, str(args.csv))  # what is written loads back
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        args.csv.write_text(csv_text)
        print(
            f"wrote {args.csv} ({len(table_rows)} rows, TP {', '.join(map(str, sorted({r.tp for r in table_rows})))})"
        )
    for path in ([args.out] if args.out is not None else []) + ([DEFAULT_TABLE_PATH] if args.write_default else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


def _from_vidur(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`--from-vidur`: a step table from Vidur's published profile (profile_vidur.py); nothing is measured."""
    from nitsum.bench.profile_vidur import VidurProfileError, model_of_dir, read_text, vidur_rows
    from nitsum.policy.costmodel import device_spec, model_spec
    from nitsum.policy.steptable import parse_rows, write_rows

    if args.all_reduce is None or args.csv is None:
        parser.error("--from-vidur needs --all-reduce FILE and --csv FILE")
    try:
        # --model DIR: that checkpoint's shapes, its rows named as the coordinator names the served model
        model = model_spec(args.preset) if args.model is None else model_of_dir(args.model)
        device = device_spec(args.device_kind)
        rows = vidur_rows(
            read_text(args.from_vidur),
            read_text(args.all_reduce),
            model,
            device,
            args.device_kind,
            str(args.from_vidur),
            str(args.all_reduce),
        )
    except (VidurProfileError, ValueError) as exc:
        print(f"nitsum bench profile: {exc}", file=sys.stderr)
        return 2
    text = write_rows(rows)
    parse_rows(text, str(args.csv))  # what is written loads back
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    args.csv.write_text(text)
    levels = ", ".join(map(str, sorted({r.tp for r in rows})))
    print(f"wrote {args.csv} ({len(rows)} rows, {args.device_kind}/{model.name}, TP {levels}) from {args.from_vidur}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
