"""What every experiment shares: output folder, CSV / Markdown writers, the PNG plot, a progress bar."""

from __future__ import annotations

import csv
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from nitsum.policy.steptable import StepRow, StepTableError, load_step_rows, table_pairs


@dataclass
class Progress:
    """A one-line progress bar on stderr: done/total, elapsed, and the simulated/wall ratio so far."""

    total: int
    label: str
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    done: int = 0
    sim_s: float = 0.0
    events: int = 0
    started: float = field(default_factory=time.perf_counter)

    def step(self, note: str = "", sim_s: float = 0.0, events: int = 0) -> None:
        self.done += 1
        self.sim_s += sim_s
        self.events += events
        wall = max(time.perf_counter() - self.started, 1e-9)
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} {wall:6.1f}s "
            f"sim/wall {self.sim_s / wall:7.1f}x {self.events / wall:9.0f} ev/s {note[:40]:<40}"
        )
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()

    def summary(self) -> str:
        wall = max(time.perf_counter() - self.started, 1e-9)
        return (
            f"{self.label}: {self.done} runs, {wall:.1f} s wall, {self.sim_s:.1f} s simulated "
            f"(simulated/wall {self.sim_s / wall:.1f}x), {self.events} events ({self.events / wall:,.0f} events/s)"
        )


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v) for k, v in r.items()})


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def ratio_text(x: float | None) -> str:
    """A figure for a report's prose: two decimals, or n/a."""
    return "n/a" if x is None else f"{x:.2f}"


def md_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    body = ""
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            cells.append(f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v)))
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def plot_lines(path: Path, panels: Sequence[dict[str, Any]], title: str) -> bool:
    """panels: [{"ylabel", "xlabel", "series": {name: ([x], [y])}, "logy": bool}]; False if matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is optional; CSV and Markdown are the record
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2))
    if len(panels) == 1:
        axes = [axes]
    for ax, p in zip(axes, panels):
        for name, (xs, ys) in p["series"].items():
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
        ax.set_xlabel(p.get("xlabel", ""))
        ax.set_ylabel(p.get("ylabel", ""))
        if p.get("logy"):
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def table_target(
    device_table: str | Path | None, model: str, device: str
) -> tuple[str, str, tuple[StepRow, ...] | None]:
    """(model, device kind, rows) an experiment runs with `--device-table FILE`: the experiment's own model and
    device when the table has rows for them, else the table's only (device, model) pair; otherwise a
    StepTableError naming what the table holds. Without a table: the experiment's defaults, no rows."""
    if device_table is None:
        return model, device, None
    rows = load_step_rows(device_table)
    pairs = table_pairs(rows)
    if (device, model) in pairs:
        return model, device, rows
    if len(pairs) == 1:
        return pairs[0][1], pairs[0][0], rows
    have = ", ".join(f"{d}/{m}" for d, m in pairs)
    raise StepTableError(
        f"{device_table}: no rows for {device}/{model} and more than one device/model to choose from ({have})"
    )
