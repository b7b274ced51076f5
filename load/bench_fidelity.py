"""`nitsum bench fidelity`: the simulator against the live mesh on the same slice of a real trace.

Each session takes the next 2 x `--requests` rows of the Azure conversation trace, rescaled to `--rate`
requests/s (the trace's burstiness kept) and capped to `--max-prompt-tokens` / `--max-output-tokens` so the CPU
mesh sustains them; they are
- sent to a fresh live `nitsum up --devices 1 --policy P` by the load generator (token-id prompts on
  /v1/completions, so the prompt lengths are exact; ignore_eos, so the output lengths are exact), and
- replayed by the cluster simulator (`nitsum.sim.cluster`) with the same policy, one device, the worker's
  batch limits and step budget, and the CPU device table (nitsum/data/costmodel/cpu.json, which
  `nitsum bench profile` writes).
Rows alternate between **evaluation** (even rows) and **calibration** (odd rows). Both run on the mesh and in
the simulator together (they load the mesh together), but only the evaluation rows are compared and only the
calibration rows are used to measure the service model, so nothing is fitted to what is scored.

The device table times engine steps only. What the mesh adds (the request path through HTTP, gateway, NATS and
coordinator and back; the worker's per-step work around the engine; the slowdowns of a shared CPU) is measured
per session on its calibration rows as empirical distributions (`nitsum.sim.service.calibrate_service`): per
request, live TTFT - simulated TTFT (the path) and live TPOT / simulated TPOT (the decode-step ratio, drawn per
window as long as the longest calibration decode, a request keeping the draw of the window its decode starts in),
against a simulation of the session's slice slowed by the typical ratio (a fixed point from the bare table).
The simulator then runs again with that `ServiceModel` (seeded draws); the evaluation rows of all sessions are
pooled, and the simulator's figures are over all `--seeds` seeds pooled, with the range of single seeds beside
them. Both comparisons are printed, with the live figures' own bootstrap spread and where the live time goes
according to the services' spans. Goal: |error| <= 15%.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nitsum.policy.costmodel import load_device_table
from nitsum_load.client import PROMPT_TOKEN_ID_SPAN

# Re-exported: the tests reach the pieces through this module (`bench_fidelity as bf`).
from nitsum_load.fidelity_diagnostics import (  # noqa: F401
    bootstrap_intervals,
    format_breakdown,
    path_breakdown,
    per_request_rows,
)
from nitsum_load.fidelity_live import replayed, run_live
from nitsum_load.fidelity_report import compare, format_rows, over_seeds, report_sessions, side_by_side  # noqa: F401
from nitsum_load.fidelity_sim import (  # noqa: F401
    FIXED_POINT_ROUNDS,
    Session,
    analyse,
    build_workload,
    describe,
    interleave,
    simulate,
    split_rows,
)

# The pieces: fidelity_sim (the slice, the simulator, one session's analysis), fidelity_live (the live mesh or a
# saved run), fidelity_report (the figures printed and the files of --out), fidelity_diagnostics (spans, spread).


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nitsum bench fidelity",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default="azure-conv")
    p.add_argument(
        "--requests", type=int, default=50, help="evaluation rows per session (as many calibration rows interleave)"
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=1,
        help="fresh meshes on consecutive slices of the trace, pooled (more requests for the p90s)",
    )
    p.add_argument("--rate", type=float, default=4.0, help="mean arrival rate after rescaling (requests/s)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--policy", default="static-tp:1", help="policy of both the mesh and the simulator")
    p.add_argument(
        "--device-table",
        type=Path,
        default=None,
        help="device table JSON for the simulator (default: the shipped nitsum/data/costmodel/cpu.json)",
    )
    p.add_argument(
        "--seeds", type=int, default=40, help="simulator runs with the service model (figures over all of them pooled)"
    )
    p.add_argument("--url", default=None, help="measure this running one-worker mesh instead of starting one")
    p.add_argument(
        "--cpu-affinity",
        choices=("auto", "off"),
        default="auto",
        help="`nitsum up --cpu-affinity` of the mesh the bench starts (auto: the worker on a CPU of its own)",
    )
    p.add_argument(
        "--replay",
        type=Path,
        default=None,
        help="no live run: the live records of a run saved with --out (its slice settings win)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write session-K/{live,live-calibration}, sim/, sim-service/, requests.csv, path.csv and "
        "fidelity.json here",
    )
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    saved: dict[str, Any] = {}
    if args.replay is not None:
        if not (args.replay / "fidelity.json").is_file():
            p.error(f"--replay: {args.replay} holds no fidelity.json (a directory written by --out)")
        saved = json.loads((args.replay / "fidelity.json").read_text())
        for key in ("trace", "requests", "sessions", "rate", "max_prompt_tokens", "max_output_tokens", "policy"):
            setattr(args, key, saved["settings"][key])
    if args.requests < 2 or not args.rate > 0 or args.max_prompt_tokens < 1 or args.max_output_tokens < 1:
        p.error("need --requests >= 2, --rate > 0 and positive token caps")
    if 2 * args.requests > PROMPT_TOKEN_ID_SPAN:
        # Token-id prompt i is ids 100 + (i + j) mod 100: rows i and i + 100 would share their prompt and hit the
        # engine's prefix cache, which the simulator does not model.
        p.error(f"--requests at most {PROMPT_TOKEN_ID_SPAN // 2}: more rows would repeat prompts")
    if args.sessions < 1 or (args.url is not None and args.sessions > 1):
        p.error("--sessions must be >= 1, and 1 with --url (a running mesh keeps its prefix cache)")
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.device_table is not None and not args.device_table.is_file():
        p.error(f"--device-table: no such file {args.device_table}")
    table = load_device_table(args.device_table)
    if table.placeholder:
        print("warning: the CPU device table holds placeholder figures; run `nitsum bench profile` first", flush=True)
    sessions = []
    for k in range(args.sessions):
        workload = build_workload(
            args.trace,
            2 * args.requests,
            args.rate,
            args.max_prompt_tokens,
            args.max_output_tokens,
            first_row=2 * args.requests * k,
        )
        if args.replay is None:
            sessions.append(Session(k, workload, *run_live(args, workload)))
        else:
            sessions.append(replayed(args.replay, k, workload, saved["wall0_unix_ms"][k]))
            print(f"replaying session {k} of {args.replay}")
        analyse(sessions[-1], args, table)
        print(
            f"  session {k} service model: {describe(sessions[-1].calibration)}; typical ratio "
            + " -> ".join(f"{m:.2f}" for m in sessions[-1].ratios_tried),
            flush=True,
        )
    report_sessions(args, table, sessions)
    return 0
