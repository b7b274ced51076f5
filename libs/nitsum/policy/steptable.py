"""Measured step-time tables: how a user calibrates nitsum from their own GPU (or CPU) measurements.

Format (CSV, one header line, any row order, several devices / models in one file allowed):

    device,model,tp,phase,batch_size,prompt_tokens,context_tokens,ms
    h100,llama-3-70b,8,prefill,1,2048,2048,61.2
    h100,llama-3-70b,8,decode,32,0,1024,14.9

- `prefill`: one step computing `batch_size` prompts of `prompt_tokens` each (no cached prefix);
  `context_tokens` is not used for prefill rows (write the prompt length or 0).
- `decode`: one step of `batch_size` sequences of `context_tokens` each (one new token per sequence);
  `prompt_tokens` is not used for decode rows.
- `ms`: the step's wall time. `tp` a power of two. `nitsum bench profile --csv FILE` writes this format.

A malformed table is refused (`StepTableError`) naming the line and the column; nothing is loaded then.

How a step is priced (`DeviceStepTable.step_ms`, what `CostModel.step_time_ms` returns with a table):
- a step is a *decode* step when it computes one token per sequence, a *prefill* step when it attends to
  nothing but its own tokens (coordinates: per-sequence context resp. prompt length, and batch size);
- at a measured point: the measured time, exactly. Between points of one (tp, phase): linear along the
  token axis within each measured batch size, then linear in batch size between the two neighbouring
  batch sizes (no full grid is required);
- outside the measured range: the roofline *fitted to the table* (below), scaled to meet the nearest
  measured value (so the curve is continuous at the edge and roofline-shaped beyond it);
- a TP level the table lacks: the fit at that TP, scaled by the measured/fit ratio of the nearest level;
- a mixed step (chunked prefill beside decodes, or a chunk over a cached prefix): the fit of the whole step,
  scaled by the fit-weighted mean of the measured/fit ratios of its decode part and its prefill part.

The fit (`fit_table`, stdlib only): step ≈ a·FLOPs/rank + b·bytes/rank + m·all-reduce bytes/rank
+ c·collectives + d, the FLOPs, bytes and all-reduce sizes taken from the cost model's formulas for the
model (costmodel.py), non-negative coefficients minimising the squared relative error. With a fixed
per-collective term it can express what real engines show and a data-sheet roofline does not: TP8 decode
barely faster than TP4.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

COLUMNS = ("device", "model", "tp", "phase", "batch_size", "prompt_tokens", "context_tokens", "ms")
PHASES = ("prefill", "decode")


class StepTableError(ValueError):
    """A malformed step table: the message names the source, line and column."""


@dataclass(frozen=True)
class StepRow:
    device: str
    model: str
    tp: int
    phase: str
    batch_size: int
    prompt_tokens: int
    context_tokens: int
    ms: float

    @property
    def tokens(self) -> int:
        """The row's token coordinate: per-sequence prompt (prefill) or context (decode) length."""
        return self.prompt_tokens if self.phase == "prefill" else self.context_tokens


def _int_cell(source: str, line: int, col: str, text: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        try:  # spreadsheets and pandas write whole counts as `8.0`
            f = float(text)
        except ValueError:
            f = math.nan
        if not (math.isfinite(f) and f.is_integer()):
            raise StepTableError(f"{source}: line {line}, column {col!r}: {text!r} is not an integer") from None
        value = int(f)
    if value < minimum:
        raise StepTableError(f"{source}: line {line}, column {col!r}: {value} must be >= {minimum}")
    return value


def parse_rows(text: str, source: str = "<table>") -> tuple[StepRow, ...]:
    """Rows of a CSV step table; StepTableError naming line and column for anything malformed."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise StepTableError(f"{source}: empty table (expected the header {','.join(COLUMNS)})") from None
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise StepTableError(
            f"{source}: line 1 (header): missing column(s) {', '.join(missing)}; expected {','.join(COLUMNS)}"
        )
    extra = [h for h in header if h not in COLUMNS]
    if extra:
        raise StepTableError(f"{source}: line 1 (header): unknown column(s) {', '.join(extra)}")
    index = {c: header.index(c) for c in COLUMNS}
    rows: list[StepRow] = []
    seen: dict[tuple, int] = {}
    for line, cells in enumerate(reader, start=2):
        if not cells or all(not c.strip() for c in cells):
            continue
        if len(cells) != len(header):
            raise StepTableError(f"{source}: line {line}: {len(cells)} cells, the header has {len(header)}")
        cell = {c: cells[i] for c, i in index.items()}
        device, model = cell["device"].strip(), cell["model"].strip()
        for col, value in (("device", device), ("model", model)):
            if not value:
                raise StepTableError(f"{source}: line {line}, column {col!r}: empty")
        tp = _int_cell(source, line, "tp", cell["tp"], 1)
        if tp & (tp - 1):
            raise StepTableError(f"{source}: line {line}, column 'tp': {tp} is not a power of two")
        phase = cell["phase"].strip()
        if phase not in PHASES:
            raise StepTableError(f"{source}: line {line}, column 'phase': {phase!r} is not one of {', '.join(PHASES)}")
        batch = _int_cell(source, line, "batch_size", cell["batch_size"], 1)
        prompt = _int_cell(source, line, "prompt_tokens", cell["prompt_tokens"], 1 if phase == "prefill" else 0)
        context = _int_cell(source, line, "context_tokens", cell["context_tokens"], 1 if phase == "decode" else 0)
        try:
            ms = float(cell["ms"].strip())
        except ValueError:
            raise StepTableError(f"{source}: line {line}, column 'ms': {cell['ms']!r} is not a number") from None
        if not math.isfinite(ms) or ms <= 0:
            raise StepTableError(f"{source}: line {line}, column 'ms': {ms} must be a positive finite time")
        row = StepRow(device, model, tp, phase, batch, prompt, context, ms)
        key = (device, model, tp, phase, batch, row.tokens)
        if key in seen:
            raise StepTableError(
                f"{source}: line {line}: the same point as line {seen[key]} "
                f"({device} {model} TP{tp} {phase} batch {batch}, {row.tokens} tokens)"
            )
        seen[key] = line
        rows.append(row)
    if not rows:
        raise StepTableError(f"{source}: no rows after the header")
    return tuple(rows)


def load_step_rows(path: str | Path) -> tuple[StepRow, ...]:
    p = Path(path)
    if not p.is_file():
        raise StepTableError(f"step table {str(p)!r}: no such file")
    return parse_rows(p.read_text(encoding="utf-8-sig"), str(p))  # -sig: a spreadsheet's byte-order mark


def write_rows(rows: list[StepRow] | tuple[StepRow, ...]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([r.device, r.model, r.tp, r.phase, r.batch_size, r.prompt_tokens, r.context_tokens, f"{r.ms:.6g}"])
    return out.getvalue()


def table_pairs(rows: tuple[StepRow, ...]) -> list[tuple[str, str]]:
    """(device, model) pairs present, in first-seen order."""
    return list(dict.fromkeys((r.device, r.model) for r in rows))


# ---- the fit ------------------------------------------------------------------------------------------


def features(model, tp: int, batch_size: int, num_tokens: int, context_tokens: int) -> tuple[float, ...]:
    """(FLOPs/rank, bytes/rank, all-reduce bytes/rank, collectives, 1) of one step: the cost model's terms."""
    batch = max(batch_size, 1)
    pairs = num_tokens * context_tokens / batch
    flops = (2.0 * model.active_params * num_tokens + 4.0 * model.num_layers * model.hidden_size * pairs) / tp
    nbytes = model.weight_bytes / tp + context_tokens * model.kv_bytes_per_token / min(tp, model.num_kv_heads)
    if tp > 1:
        msg = num_tokens * model.hidden_size * model.kv_bytes_per_elem
        comm = 2 * model.num_layers * 2.0 * (tp - 1) / tp * msg
        colls = 2.0 * model.num_layers
    else:
        comm = colls = 0.0
    return (flops, nbytes, comm, colls, 1.0)


def _solve(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(y)
    m = [row[:] + [y[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    for c in range(col, n + 1):
                        m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls_small(columns: list[list[float]], target: list[float]) -> list[float]:
    """Non-negative least squares over a handful of columns, by trying every subset (exact for so few)."""
    k = len(columns)
    best, best_err = [0.0] * k, sum(t * t for t in target)
    for size in range(1, k + 1):
        for subset in combinations(range(k), size):
            cols = [columns[i] for i in subset]
            if any(not any(c) for c in cols):
                continue
            ata = [[sum(x * z for x, z in zip(ci, cj)) for cj in cols] for ci in cols]
            aty = [sum(x * t for x, t in zip(ci, target)) for ci in cols]
            coef = _solve(ata, aty)
            if coef is None or any(c < 0 for c in coef):
                continue
            err = sum((sum(c * col[j] for c, col in zip(coef, cols)) - t) ** 2 for j, t in enumerate(target))
            if err < best_err - 1e-15:
                best_err = err
                best = [0.0] * k
                for i, c in zip(subset, coef):
                    best[i] = c
    return best


def fit_table(model, rows: tuple[StepRow, ...]) -> tuple[float, ...]:
    """Coefficients (a, b, m, c, d) of the fitted roofline (module docstring)."""
    feats = [features(model, *_step_args(r.tp, r.phase, r.batch_size, r.tokens)) for r in rows]
    scale = [max((f[i] for f in feats), default=0.0) or 1.0 for i in range(5)]
    # Relative error: each row divided by its measurement; columns scaled to ~1 for conditioning.
    columns = [[f[i] / scale[i] / r.ms for f, r in zip(feats, rows)] for i in range(5)]
    coef = nnls_small(columns, [1.0] * len(rows))
    return tuple(c / s for c, s in zip(coef, scale))


def _step_args(tp: int, phase: str, batch: float, tokens: float) -> tuple[int, int, int, int]:
    b = max(int(round(batch)), 1)
    t = max(int(round(tokens)), 1)
    if phase == "decode":
        return tp, b, b, b * t
    return tp, b, b * t, b * t


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    if x1 == x0:
        return y0
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class DeviceStepTable:
    """One device's measured steps for one model, with the roofline fitted to them."""

    device: str
    model: object  # costmodel.ModelSpec (not imported here: costmodel imports this module)
    rows: tuple[StepRow, ...]
    coef: tuple[float, ...] = ()
    # (tp, phase) -> sorted batch sizes, and per batch size the sorted (tokens, ms) points
    _grid: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.coef:
            object.__setattr__(self, "coef", fit_table(self.model, self.rows))
        grid: dict = {}
        for r in self.rows:
            grid.setdefault((r.tp, r.phase), {}).setdefault(r.batch_size, []).append((r.tokens, r.ms))
        for by_batch in grid.values():
            for pts in by_batch.values():
                pts.sort()
        self._grid.update({k: (sorted(v), v) for k, v in grid.items()})

    @property
    def tp_levels(self) -> tuple[int, ...]:
        return tuple(sorted({r.tp for r in self.rows}))

    def fit_ms(self, tp: int, batch_size: int, num_tokens: int, context_tokens: int) -> float:
        f = features(self.model, tp, batch_size, num_tokens, context_tokens)
        return max(sum(c * x for c, x in zip(self.coef, f)), 1e-9)

    def _fit_at(self, tp: int, phase: str, batch: float, tokens: float) -> float:
        return self.fit_ms(*_step_args(tp, phase, batch, tokens))

    def _row_value(self, tp: int, phase: str, batch: int, pts: list, tokens: float) -> float:
        xs = [p[0] for p in pts]
        if tokens <= xs[0] or tokens >= xs[-1]:
            edge = pts[0] if tokens <= xs[0] else pts[-1]
            if tokens == edge[0]:
                return edge[1]
            return self._fit_at(tp, phase, batch, tokens) * edge[1] / self._fit_at(tp, phase, batch, edge[0])
        i = bisect.bisect_left(xs, tokens)
        if xs[i] == tokens:
            return pts[i][1]
        return _lerp(tokens, xs[i - 1], xs[i], pts[i - 1][1], pts[i][1])

    def phase_ms(self, tp: int, phase: str, batch: float, tokens: float) -> float:
        """A pure prefill or decode step at (batch size, per-sequence tokens): see the module docstring."""
        cell = self._grid.get((tp, phase))
        if cell is None:
            near = [k for k in self.tp_levels if (k, phase) in self._grid]
            if not near:
                return self._fit_at(tp, phase, batch, tokens)
            k = min(near, key=lambda x: (abs(math.log2(x) - math.log2(tp)), x))
            return (
                self._fit_at(tp, phase, batch, tokens)
                * self.phase_ms(k, phase, batch, tokens)
                / self._fit_at(k, phase, batch, tokens)
            )
        batches, by_batch = cell
        if batch <= batches[0] or batch >= batches[-1]:
            edge = batches[0] if batch <= batches[0] else batches[-1]
            v = self._row_value(tp, phase, edge, by_batch[edge], tokens)
            if batch == edge:
                return v
            return self._fit_at(tp, phase, batch, tokens) * v / self._fit_at(tp, phase, edge, tokens)
        i = bisect.bisect_left(batches, batch)
        hi = batches[i]
        if hi == batch:
            return self._row_value(tp, phase, hi, by_batch[hi], tokens)
        lo = batches[i - 1]
        return _lerp(
            batch,
            lo,
            hi,
            self._row_value(tp, phase, lo, by_batch[lo], tokens),
            self._row_value(tp, phase, hi, by_batch[hi], tokens),
        )

    def step_ms(self, tp: int, batch_size: int, num_tokens: int, context_tokens: int) -> float:
        """`CostModel.step_time_ms` from this table (module docstring)."""
        b = max(batch_size, 1)
        if num_tokens <= b:  # decode: one token per sequence
            return self.phase_ms(tp, "decode", b, context_tokens / b)
        if context_tokens <= num_tokens:  # prefill of equal prompts, no cached prefix
            return self.phase_ms(tp, "prefill", b, num_tokens / b)
        # Mixed: b - 1 decodes beside one chunk of the remaining tokens (the engine's hybrid step).
        dec = b - 1
        pre = num_tokens - dec
        whole = self.fit_ms(tp, b, num_tokens, context_tokens)
        pre_fit = self._fit_at(tp, "prefill", 1, pre)
        ratio_pre = self.phase_ms(tp, "prefill", 1, pre) / pre_fit
        if dec <= 0:
            return whole * ratio_pre
        dec_ctx = max((context_tokens - pre) / dec, 1.0)
        dec_fit = self._fit_at(tp, "decode", dec, dec_ctx)
        ratio_dec = self.phase_ms(tp, "decode", dec, dec_ctx) / dec_fit
        return whole * (ratio_pre * pre_fit + ratio_dec * dec_fit) / (pre_fit + dec_fit)


def select(rows: tuple[StepRow, ...], device: str, model, source: str = "<table>") -> DeviceStepTable:
    """The rows of one (device, model) with their fit; StepTableError naming what the table holds otherwise."""
    mine = tuple(r for r in rows if r.device == device and r.model == model.name)
    if not mine:
        have = ", ".join(f"{d}/{m}" for d, m in table_pairs(rows))
        raise StepTableError(
            f"{source}: no rows for device {device!r} and model {model.name!r} (the table has: {have})"
        )
    return DeviceStepTable(device, model, mine)


__all__ = [
    "COLUMNS",
    "DeviceStepTable",
    "PHASES",
    "StepRow",
    "StepTableError",
    "fit_table",
    "load_step_rows",
    "parse_rows",
    "select",
    "table_pairs",
    "write_rows",
]
