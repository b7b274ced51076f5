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
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from nitsum.policy.costmodel import CostModel, DeviceSpec, ModelSpec, load_device_table

DEFAULT_TABLE_PATH = Path(__file__).resolve().parents[1] / "data" / "costmodel" / "cpu.json"

# (batch, context per sequence) for decode; (batch, prompt tokens per sequence) for prefill.
FULL_DECODE_GRID = ((1, 16), (1, 512), (1, 1536), (8, 16), (8, 512), (8, 1536), (32, 16), (32, 256), (32, 1024))
FULL_PREFILL_GRID = ((1, 16), (1, 64), (1, 256), (1, 1024), (4, 64), (4, 256), (16, 64))
QUICK_DECODE_GRID = ((1, 16), (1, 128), (4, 16), (4, 128))
QUICK_PREFILL_GRID = ((1, 16), (1, 128), (4, 64))


@dataclass(frozen=True)
class StepPoint:
    """One measured step shape: `num_tokens` computed for `batch_size` sequences attending to
    `context_tokens` tokens in total (the cost model's step_time_ms arguments at TP=1)."""

    kind: str  # "decode" | "prefill"
    batch_size: int
    num_tokens: int
    context_tokens: int
    step_ms: float  # fastest of the timed steps


@dataclass(frozen=True)
class RooflineFit:
    ms_per_flop: float
    ms_per_byte: float
    step_overhead_ms: float
    compute_identified: bool  # False: no point compute-bound; ms_per_flop is the bound that keeps it so
    memory_identified: bool
    mean_abs_pct_error: float
    ms_per_seq: float = 0.0  # d: per sequence in the step
    prefill_step_ms: float = 0.0  # e: once per step with prompt tokens

    @property
    def effective_flops(self) -> float:
        return 1e3 / self.ms_per_flop if self.ms_per_flop > 0 else math.inf

    @property
    def effective_bytes_per_s(self) -> float:
        return 1e3 / self.ms_per_byte if self.ms_per_byte > 0 else math.inf


# ---- functional core ------------------------------------------------------------------------------------


def roofline_terms(model: ModelSpec, point: StepPoint) -> tuple[float, float]:
    """(FLOPs, bytes read) of one TP=1 step, taken from the cost model's own formulas: with a unit device
    (1e3 FLOP/s, efficiency 1, no overhead) and the other resource unlimited, step_time_ms is the term."""
    flops_device = DeviceSpec(
        "unit-flops",
        peak_flops=1e3,
        mem_bandwidth_bytes_per_s=1e300,
        link_bandwidth_bytes_per_s=1.0,
        memory_bytes=1.0,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        step_overhead_ms=0.0,
    )
    bytes_device = dataclasses.replace(flops_device, name="unit-bytes", peak_flops=1e300, mem_bandwidth_bytes_per_s=1e3)
    flops = CostModel(model, flops_device).step_time_ms(1, point.batch_size, point.num_tokens, point.context_tokens)
    num_bytes = CostModel(model, bytes_device).step_time_ms(1, point.batch_size, point.num_tokens, point.context_tokens)
    return flops, num_bytes


def predict_ms(fit: RooflineFit, flops: float, num_bytes: float, batch_size: int = 1, prefill: bool = False) -> float:
    return (
        max(flops * fit.ms_per_flop, num_bytes * fit.ms_per_byte)
        + fit.step_overhead_ms
        + fit.ms_per_seq * batch_size
        + (fit.prefill_step_ms if prefill else 0.0)
    )


def _nnls(columns: list[list[float]], target: list[float]) -> list[float]:
    """Non-negative least squares over at most 5 columns by trying every subset (exact for so few)."""
    import numpy as np

    a = np.array(columns, dtype=float).T  # [points, columns]
    y = np.array(target, dtype=float)
    best, best_err = [0.0] * len(columns), float(np.sum(y * y))
    for k in range(1, len(columns) + 1):
        for subset in combinations(range(len(columns)), k):
            sub = a[:, subset]
            if not np.any(sub):
                continue
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err - 1e-15:
                best = [0.0] * len(columns)
                for i, c in zip(subset, coef):
                    best[i] = float(c)
                best_err = err
    return best


def _mape(
    flops: list[float],
    num_bytes: list[float],
    measured: list[float],
    a: float,
    b: float,
    c: float,
    extra: list[list[float]] = (),
    coef: list[float] = (),
) -> float:
    total = 0.0
    for i, (f, x, t) in enumerate(zip(flops, num_bytes, measured)):
        q = max(f * a, x * b) + c + sum(k * col[i] for k, col in zip(coef, extra))
        total += abs(q - t) / t
    return total / len(measured)


def fit_roofline(
    flops: list[float],
    num_bytes: list[float],
    measured_ms: list[float],
    batch_sizes: list[int] | None = None,
    prefill: list[bool] | None = None,
    max_iterations: int = 50,
) -> RooflineFit:
    """Fit step_ms = max(flops·a, bytes·b) + c [+ d·batch] [+ e·prefill] to measurements, minimising the squared
    relative error. Without `batch_sizes` / `prefill` those terms are left out (d = e = 0)."""
    assert len(flops) == len(num_bytes) == len(measured_ms) >= 3, "at least three measured points"
    assert all(t > 0 for t in measured_ms), "measured step times must be positive"
    n = len(measured_ms)
    weight = [1.0 / t for t in measured_ms]  # relative error: each row divided by its measurement
    target = [1.0] * n
    extra = ([[float(v) for v in batch_sizes]] if batch_sizes is not None else []) + (
        [[1.0 if v else 0.0 for v in prefill]] if prefill is not None else []
    )
    assert all(len(col) == n for col in extra), "one batch size / prefill flag per point"
    extra_cols = [[v * w for v, w in zip(col, weight)] for col in extra]
    starts = [[True] * n, [False] * n]
    # A third start: which term dominates under a fit of the sum (no max).
    a0, b0, *_ = _nnls(
        [[f * w for f, w in zip(flops, weight)], [x * w for x, w in zip(num_bytes, weight)], weight, *extra_cols],
        target,
    )
    starts.append([f * a0 >= x * b0 for f, x in zip(flops, num_bytes)])
    best: tuple | None = None
    for compute_bound in starts:
        for _ in range(max_iterations):
            cols = [
                [f * w if cb else 0.0 for f, w, cb in zip(flops, weight, compute_bound)],
                [x * w if not cb else 0.0 for x, w, cb in zip(num_bytes, weight, compute_bound)],
                weight,
                *extra_cols,
            ]
            a, b, c, *coef = _nnls(cols, target)
            a_ok, b_ok = a > 0 and any(compute_bound), b > 0 and not all(compute_bound)
            # An unidentified term: the slowest rate that still binds at no point (ties at the tightest).
            if not a_ok:
                a = min(x * b / f for f, x in zip(flops, num_bytes) if f > 0) if b_ok else 0.0
            if not b_ok:
                b = min(f * a / x for f, x in zip(flops, num_bytes) if x > 0) if a_ok else 0.0
            new_bound = [f * a >= x * b for f, x in zip(flops, num_bytes)]
            if new_bound == compute_bound:
                break
            compute_bound = new_bound
        err = _mape(flops, num_bytes, measured_ms, a, b, c, extra, coef)
        if best is None or err < best[3]:
            best = (a, b, c, err, a_ok, b_ok, coef)
    a, b, c, err, a_ok, b_ok, coef = best
    named = dict(zip(([] if batch_sizes is None else ["seq"]) + ([] if prefill is None else ["prefill"]), coef))
    return RooflineFit(a, b, c, a_ok, b_ok, err, named.get("seq", 0.0), named.get("prefill", 0.0))


def fitted_device(
    base: DeviceSpec, fit: RooflineFit, peak_flops: float, peak_bytes_per_s: float, source: str
) -> DeviceSpec:
    """`base` with the fitted rates, written as measured peak × efficiency (efficiency = fitted / peak;
    a fitted rate above the measured peak raises the peak, efficiency 1). A term the data bounds only from
    below takes the measured peak when that is higher: the device's own figure, still consistent with
    every measured point."""

    def rate(fitted: float, identified: bool, peak: float) -> float:
        if identified:
            return fitted
        return peak if not math.isfinite(fitted) else max(fitted, peak)

    eff_flops = rate(fit.effective_flops, fit.compute_identified, peak_flops)
    eff_bytes = rate(fit.effective_bytes_per_s, fit.memory_identified, peak_bytes_per_s)
    peak_flops = max(peak_flops, eff_flops)
    peak_bytes_per_s = max(peak_bytes_per_s, eff_bytes)
    return dataclasses.replace(
        base,
        name="cpu",
        peak_flops=peak_flops,
        compute_efficiency=eff_flops / peak_flops,
        mem_bandwidth_bytes_per_s=peak_bytes_per_s,
        memory_efficiency=eff_bytes / peak_bytes_per_s,
        step_overhead_ms=fit.step_overhead_ms,
        seq_overhead_ms=fit.ms_per_seq,
        prefill_step_overhead_ms=fit.prefill_step_ms,
        source=source,
        placeholder=False,
    )


def table_json(
    device: DeviceSpec, points: list[StepPoint], predicted_ms: list[float], fit: RooflineFit, command: str
) -> str:
    """The device table (`DeviceSpec.to_json` format) plus the raw points under "measurements", which the
    loader skips."""
    data = json.loads(device.to_json())
    data["measurements"] = {
        "command": command,
        "mean_abs_pct_error": round(100 * fit.mean_abs_pct_error, 2),
        "compute_identified": fit.compute_identified,
        "memory_identified": fit.memory_identified,
        "points": [
            {**dataclasses.asdict(p), "step_ms": round(p.step_ms, 4), "predicted_ms": round(q, 4)}
            for p, q in zip(points, predicted_ms)
        ],
    }
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def format_report(points: list[StepPoint], predicted_ms: list[float], baseline_ms: list[float]) -> str:
    lines = [
        "| kind | batch | tokens | context | measured ms | fitted ms | error | replaced table ms | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p, q, base in zip(points, predicted_ms, baseline_ms):
        lines.append(
            f"| {p.kind} | {p.batch_size} | {p.num_tokens} | {p.context_tokens} | {p.step_ms:.3f} | {q:.3f} | "
            f"{100 * (q - p.step_ms) / p.step_ms:+.0f}% | {base:.3f} | {100 * (base - p.step_ms) / p.step_ms:+.0f}% |"
        )
    return "\n".join(lines)


def mean_abs_pct_error(predicted_ms: list[float], measured_ms: list[float]) -> float:
    return sum(abs(q - t) / t for q, t in zip(predicted_ms, measured_ms)) / len(measured_ms)


# ---- measurement shell ----------------------------------------------------------------------------------


def model_spec_of(model_dir: Path) -> ModelSpec:
    from nitsum.model.loader import load_config

    cfg = load_config(model_dir)
    spec = ModelSpec(
        Path(model_dir).name,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
        bytes_per_param=4.0,
        kv_bytes_per_elem=4.0,
    )
    if spec.head_dim != cfg.head_dim:
        print(
            f"note: head_dim {cfg.head_dim} != hidden/heads {spec.head_dim}; the cost model assumes the latter",
            file=sys.stderr,
        )
    return spec


def engine_config(model_dir: Path, max_batched_tokens: int, kv_cache_mb: int, seed: int):
    from nitsum.engine.params import EngineConfig

    return EngineConfig(
        model_dir=str(model_dir),
        max_num_seqs=256,
        max_num_batched_tokens=max_batched_tokens,
        kv_cache_mb=kv_cache_mb,
        enable_prefix_caching=False,
        seed=seed,
    )


class Profiler:
    """Drives one engine through controlled batches (public Engine API only)."""

    def __init__(self, model_dir: Path, max_batched_tokens: int, kv_cache_mb: int, seed: int, group=None) -> None:
        import torch

        from nitsum.engine.engine import Engine

        self.torch = torch
        self.max_batched_tokens = max_batched_tokens
        cfg = engine_config(model_dir, max_batched_tokens, kv_cache_mb, seed)
        self.engine = Engine(cfg) if group is None else Engine(cfg, group)
        self.vocab_limit = min(256, self.engine.runner.config.vocab_size)  # byte tokens: no special ids (no EOS)
        self.generator = torch.Generator().manual_seed(seed)
        self.next_id = 0

    def _prompts(self, batch: int, length: int) -> list[list[int]]:
        return [
            self.torch.randint(0, self.vocab_limit, (length,), generator=self.generator).tolist() for _ in range(batch)
        ]

    def _add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from nitsum.engine.params import SamplingParams

        ids = []
        for prompt in prompts:
            rid = f"profile-{self.next_id}"
            self.next_id += 1
            self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            ids.append(rid)
        return ids

    def warm_up(self) -> None:
        """Allocator and kernels warmed on a small batch (the first steps of a process are slower)."""
        from nitsum.engine.params import SamplingParams

        self.engine.generate(self._prompts(2, 32), SamplingParams(max_tokens=8, ignore_eos=True))

    def _timed_step(self) -> tuple[float, list, int]:
        before = self.engine.stats().num_prefill_tokens_computed
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        return elapsed_ms, outputs, self.engine.stats().num_prefill_tokens_computed - before

    def prefill(self, batch: int, length: int, repeats: int) -> StepPoint:
        times = []
        for _ in range(repeats + 1):  # the first repeat warms this shape and is not kept
            gc.collect()
            self._add(self._prompts(batch, length), max_tokens=1)
            elapsed_ms, outputs, computed = self._timed_step()
            assert computed == batch * length and len(outputs) == batch and all(o.finished for o in outputs), (
                f"prefill point ({batch}, {length}) did not run as one step: {computed} tokens, {len(outputs)} outputs"
            )
            assert not self.engine.has_unfinished(), "prefill requests must finish in their step"
            times.append(elapsed_ms)
        return StepPoint("prefill", batch, batch * length, batch * length, min(times[1:]))

    def decode(self, batch: int, context: int, steps: int) -> StepPoint:
        warm = 2
        # Sequences prefilled in early chunks decode while later ones prefill: room for those tokens too.
        prefill_steps = -(-batch * context // self.max_batched_tokens) + 1
        ids = self._add(self._prompts(batch, context), max_tokens=warm + steps + prefill_steps + 1)
        generated = dict.fromkeys(ids, 0)
        gc.collect()
        for _ in range(batch * context + 1):  # prefill (untimed) until every sequence has its first token
            outputs = self.engine.step()
            for out in outputs:
                generated[out.request_id] += len(out.new_token_ids)
            if all(generated.values()):
                break
        else:
            raise AssertionError(f"decode point ({batch}, {context}): prefill did not finish")
        times, contexts = [], []
        for i in range(warm + steps):
            context_tokens = sum(context + g for g in generated.values())  # tokens attended, new one included
            elapsed_ms, outputs, computed = self._timed_step()
            assert computed == 0 and len(outputs) == batch, (
                f"decode point ({batch}, {context}): {computed} prefill tokens, {len(outputs)} outputs"
            )
            for out in outputs:
                generated[out.request_id] += 1
            if i >= warm:
                times.append(elapsed_ms)
                contexts.append(context_tokens)
        for rid in ids:
            self.engine.abort(rid)
        assert not self.engine.has_unfinished(), "decode point left requests behind"
        return StepPoint("decode", batch, batch, round(statistics.mean(contexts)), min(times))


def csv_rows(points: list[StepPoint], tp: int, device: str, model: str) -> list:
    """The points as step-table rows (nitsum.policy.steptable: per-sequence prompt / context lengths)."""
    from nitsum.policy.steptable import StepRow

    out = []
    for p in points:
        if p.kind == "prefill":
            out.append(
                StepRow(
                    device,
                    model,
                    tp,
                    "prefill",
                    p.batch_size,
                    p.num_tokens // p.batch_size,
                    p.num_tokens // p.batch_size,
                    p.step_ms,
                )
            )
        else:
            out.append(
                StepRow(device, model, tp, "decode", p.batch_size, 0, round(p.context_tokens / p.batch_size), p.step_ms)
            )
    return out


def measure_points(profiler: Profiler, decode_grid, prefill_grid, steps: int, repeats: int) -> list[StepPoint]:
    profiler.warm_up()
    points = [profiler.decode(b, ctx, steps) for b, ctx in decode_grid]
    points += [profiler.prefill(b, n, repeats) for b, n in prefill_grid]
    return points


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile_tp(
    model_dir: Path,
    tp: int,
    quick: bool,
    threads: int,
    steps: int,
    repeats: int,
    seed: int,
    max_batched: int,
    kv_cache_mb: int,
    timeout_s: float = 600.0,
) -> list[StepPoint]:
    """The grid at TP=tp: `tp` rank processes form a node world (nitsum.parallel.world.NodeWorld, shared-memory
    collectives as the live workers use them), rank 0's engine leads the group and is timed, so every step
    includes the group's all-reduces and the step plan's broadcast."""
    import subprocess

    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="nitsum-profile-tp-") as tmp:
        out = Path(tmp) / "points.json"
        cmd = [
            sys.executable,
            "-m",
            "nitsum.bench.profile",
            "--rank-of-world",
            "",
            "--model",
            str(model_dir),
            "--threads",
            str(threads),
            "--steps",
            str(steps),
            "--repeats",
            str(repeats),
            "--seed",
            str(seed),
        ]
        if quick:
            cmd.append("--quick")
        procs = []
        for rank in range(tp):
            rank_cmd = list(cmd)
            rank_cmd[4] = json.dumps(
                {
                    "rank": rank,
                    "size": tp,
                    "port": port,
                    "out": str(out),
                    "max_batched": max_batched,
                    "kv_cache_mb": kv_cache_mb,
                }
            )
            procs.append(subprocess.Popen(rank_cmd))
        try:
            codes = [p.wait(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"TP{tp} profile: rank exit codes {codes}")
        return [StepPoint(**d) for d in json.loads(out.read_text())]


def _rank_main(spec: dict, args) -> int:
    """One rank of a TP>1 profile (see profile_tp)."""
    import torch

    from nitsum.engine.engine import run_peer
    from nitsum.parallel.world import NodeWorld

    torch.set_num_threads(args.threads)
    size = spec["size"]
    world = NodeWorld(spec["rank"], size, "127.0.0.1", spec["port"], min_tp=size, max_tp=size)
    try:
        world.attach_channels(lambda ranks: True)
        group = world.group(0, size)
        if spec["rank"] != 0:
            run_peer(engine_config(args.model, spec["max_batched"], spec["kv_cache_mb"], args.seed), group)
            return 0
        profiler = Profiler(args.model, spec["max_batched"], spec["kv_cache_mb"], args.seed, group=group)
        try:
            decode_grid = QUICK_DECODE_GRID if args.quick else FULL_DECODE_GRID
            prefill_grid = QUICK_PREFILL_GRID if args.quick else FULL_PREFILL_GRID
            points = measure_points(profiler, decode_grid, prefill_grid, args.steps, args.repeats)
        finally:
            profiler.engine.shutdown()
        Path(spec["out"]).write_text(json.dumps([dataclasses.asdict(p) for p in points]))
        return 0
    finally:
        world.destroy()


def measure_peaks(torch, repeats: int = 5) -> tuple[float, float]:
    """(FLOP/s of a 512³ fp32 matmul, bytes/s of a 64 MiB copy counted read + write), best of `repeats`."""
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best_mm = min(_time(lambda: torch.mm(a, b)) for _ in range(repeats))
    src = torch.ones(16 * 2**20)  # 64 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_copy = min(_time(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * n**3 / best_mm, 2 * src.numel() * src.element_size() / best_copy


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    parser.add_argument("--rank-of-world", default=None, help=argparse.SUPPRESS)  # internal: one rank of a TP>1 profile
    parser.add_argument(
        "--write-default",
        action="store_true",
        help=f"write the device table to the shipped {DEFAULT_TABLE_PATH.relative_to(DEFAULT_TABLE_PATH.parents[3])}",
    )
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
