"""The pure half of `nitsum bench profile` (profile.py's docstring): the measured step shapes, the roofline
fit of the cost model's CPU device table to them, and the table and report written from the fit."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from itertools import combinations

from nitsum.policy.costmodel import CostModel, DeviceSpec, ModelSpec


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
