"""`nitsum sim mixes`: which phase mixes separate the static layouts, and whether adaptive follows them.

The phased workload of `sim tiers` is fixed (docs/SIMULATOR.md): where its per-phase oracle is barely above the
best static layout, it cannot show what adaptivity is worth. Issue 17 asks for the mixes that do separate the
layouts; these are built from the cost model alone (nothing from a run), by the construction of
tests/sim/test_sim_phased.py, generalised to any table:
- the *wide* level: the uniform TP level whose groups together prefill the most Azure 2023 code prompts per second
  (throughput), among the levels whose KV room holds `topology.MIN_BATCH_SEQS` typical requests (the policy's
  own candidate rule); the *deep* level: the one whose groups meet the interactive TTFT target for the most of those
  prompts (latency). When they are the same level, nothing separates the layouts this way: reported, not run;
- batch windows: background only, code lengths, at the midpoint of the deep and the wide layout's prefill
  rates: the deep layout is overloaded, the wide one is not;
- surges: interactive only, at 2 req/s (x the table's `load_scale`, as `sim tiers` scales its rates), of the code
  prompts only the deep level prefills within the target;
- mixes: batch window, surge, batch window again, for the (window, surge) lengths of `MIXES_S`. The longer the
  window, the further the deep layout's backlog grows past the 10 s background target and the less of the window
  it serves in time; the longer the surge, the more of the load only the deep layout serves. The per-phase
  oracle can be well above the best static layout only where both hold: each layout then loses a large share of
  the weighted load (a 2 req/s interactive surge weighs 20 weighted req/s, a batch window ~11), so the grid has
  short surges beside growing windows, then surges as long as the windows.
Every fitting static layout runs, with adaptive; reported per mix: the best static layout, the per-phase oracle
and adaptive, as in `sim tiers`' phased part.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nitsum.policy.tiers import INTERACTIVE
from nitsum.policy.topology import MIN_BATCH_SEQS
from nitsum.sim.cluster import ClusterConfig
from nitsum.sim.experiments.common import Progress, md_table, plot_lines, table_target, write_csv
from nitsum.sim.experiments.tiers import fitting_static_policies, load_scale, run_phased
from nitsum.workloads import Phase, default_trace_path, phased, read_azure

MIXES_S = ((60.0, 40.0), (120.0, 40.0), (240.0, 40.0), (120.0, 120.0), (240.0, 240.0), (480.0, 480.0))
SURGE_RATE = 2.0  # req/s on the data-sheet node (x load_scale elsewhere)
MIN_SURGE_PROMPTS = 10


@dataclass(frozen=True)
class Construction:
    deep: int  # TP level that meets the TTFT target for the most prompts
    wide: int  # TP level with the highest node prefill rate
    capacity_per_s: dict[int, float]  # node prefill rate of the code prompts, per uniform level
    batch_rate: float
    surge_rate: float
    surge_prompts: int
    why_not: str  # "" when the mixes separate the layouts by construction


def construct(config: ClusterConfig, code, scale: float) -> Construction:
    cost = config.cost_model()
    levels = [
        tp
        for tp in (1, 2, 4, 8, 16, 32)
        if config.min_tp <= tp <= config.max_tp and tp <= config.devices_per_node and cost.fits(tp)
    ]

    def prefill_ms(tp: int, prompt: int) -> float:  # a group with nothing else to do: full chunks
        return cost.prefill_time_ms(tp, prompt, chunk_tokens=config.chunk_tokens)

    capacity = {
        tp: config.devices_per_node // tp * 1000.0 / (sum(prefill_ms(tp, r.prompt_tokens) for r in code) / len(code))
        for tp in levels
    }
    in_time = {tp: sum(1 for r in code if prefill_ms(tp, r.prompt_tokens) <= INTERACTIVE.ttft_ms) for tp in levels}
    # As the policy's candidates (`topology.MIN_BATCH_SEQS`): a level whose KV room holds fewer than that many typical
    # requests cannot batch, whatever its prefill rate.
    need = MIN_BATCH_SEQS * sum(r.prompt_tokens + r.output_tokens for r in code) / len(code)
    batching = [tp for tp in levels if cost.kv_capacity_tokens(tp) >= need] or levels
    wide = max(batching, key=lambda tp: (capacity[tp], -tp))
    deep = max(levels, key=lambda tp: (in_time[tp], capacity[tp]))
    surge = [
        r for r in code if prefill_ms(deep, r.prompt_tokens) <= INTERACTIVE.ttft_ms < prefill_ms(wide, r.prompt_tokens)
    ]
    why = ""
    if deep == wide:
        why = f"TP{wide} both prefills the most prompts per second and meets the TTFT target for the most"
    elif len(surge) < MIN_SURGE_PROMPTS:
        why = f"only {len(surge)} prompts are prefilled in time by TP{deep} and not by TP{wide}"
    return Construction(
        deep, wide, capacity, (capacity[deep] + capacity[wide]) / 2.0, SURGE_RATE * scale, len(surge), why
    )


def mixes(c: Construction, quick: bool) -> list[tuple[Phase, ...]]:
    return [
        (
            Phase("batch", w, c.batch_rate, 0.0),
            Phase("surge", s, c.surge_rate, 1.0),
            Phase("batch2", w, c.batch_rate, 0.0),
        )
        for w, s in (((10.0, 5.0),) if quick else MIXES_S)
    ]


def run(out: Path, quick: bool = False, seed: int = 0, device_table: Path | None = None) -> dict[str, Any]:
    model, device, table = table_target(device_table, ClusterConfig.model, ClusterConfig.device_kind)
    config = ClusterConfig(model=model, device_kind=device, device_table=table)
    scale = load_scale(config) if table is not None else 1.0
    code_path = default_trace_path("azure-code")
    code = read_azure(code_path)
    c = construct(config, code, scale)
    statics = fitting_static_policies(config)
    policies = ["adaptive"] + (statics if not quick else [p for p in ("static:8", "static:4+4") if p in statics])
    cost = config.cost_model()
    surge_lengths = [
        r
        for r in code
        if cost.prefill_time_ms(c.deep, r.prompt_tokens, chunk_tokens=config.chunk_tokens)
        <= INTERACTIVE.ttft_ms
        < cost.prefill_time_ms(c.wide, r.prompt_tokens, chunk_tokens=config.chunk_tokens)
    ]
    all_mixes = [] if c.why_not else mixes(c, quick)
    progress = Progress(len(all_mixes) * len(policies), "sim mixes")
    results = []
    for phases in all_mixes:
        reqs = phased(phases, surge_lengths, code, seed=seed)
        ph = run_phased(policies, phases, seed, progress, config, reqs=reqs)
        results.append((phases, ph))
    rows = [_row(phases, ph) for phases, ph in results]
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "mixes.csv", rows)
    for phases, ph in results:
        write_csv(out / f"mixes_{int(phases[0].duration_s)}s_{int(phases[1].duration_s)}s.csv", ph["rows"])
    if rows:
        x = list(range(len(rows)))
        keys = ("adaptive_vs_best_static", "oracle_vs_best_static")
        series = {k: (x, [r[k] for r in rows]) for k in keys}
        plot_lines(
            out / "mixes.png",
            [{"xlabel": "mix (the rows of mixes.md, in order)", "ylabel": "/ best static layout", "series": series}],
            f"{model} on 8x{device}: batch window / surge / batch window",
        )
    (out / "mixes.md").write_text(_markdown(model, device, device_table, c, code_path, rows, results, progress))
    return {"construction": c, "rows": rows, "speed": progress.summary()}


def _row(phases: tuple[Phase, ...], ph: dict[str, Any]) -> dict[str, Any]:
    by = {r["policy"]: r for r in ph["rows"]}
    ad, best, tp8 = by["adaptive"], ph["best_static"], by.get("static:8")
    return {
        "window_s": phases[0].duration_s,
        "surge_s": phases[1].duration_s,
        "best_static": best["policy"],
        "best_static_wg": best["weighted_goodput_rps"],
        "oracle_wg": ph["oracle"],
        "oracle_vs_best_static": ph["oracle_vs_best_static"],
        "adaptive_wg": ad["weighted_goodput_rps"],
        "adaptive_vs_best_static": ph["adaptive_vs_best_static"],
        "adaptive_vs_tp8": ph["adaptive_vs_tp8"],
        "tp8_wg": tp8["weighted_goodput_rps"] if tp8 else None,
        "adaptive_changes": ad["reconfigurations"],
        "oracle_layouts": ", ".join(f"{k}: {v[0]}" for k, v in ph["oracle_parts"].items()),
    }


def _markdown(model, device, device_table, c: Construction, code_path, rows, results, progress) -> str:
    source = f"`{device_table}`" if device_table else f"the data-sheet {device} table"
    caps = ", ".join(f"TP{tp} {v:.2f}" for tp, v in sorted(c.capacity_per_s.items()))
    md = [
        "# sim mixes",
        "",
        f"{model} on 8 x {device}, step times from {source}; code lengths `{code_path.name}`. Node prefill rate of "
        f"the code prompts (req/s) per uniform layout: {caps}. Deep level TP{c.deep}, wide level TP{c.wide}.",
        "",
    ]
    if c.why_not:
        md += [f"**No separating mix of this construction on this table**: {c.why_not}.", "", progress.summary(), ""]
        return "\n".join(md)
    md += [
        f"Batch windows: background only at {c.batch_rate:.2f} req/s (between TP{c.deep}'s and TP{c.wide}'s rates); "
        f"surges: interactive only at {c.surge_rate:.2f} req/s, {c.surge_prompts} prompts TP{c.deep} prefills "
        f"within {INTERACTIVE.ttft_ms:g} ms and TP{c.wide} does not.",
        "",
        md_table(rows, list(rows[0])),
        "",
    ]
    for phases, ph in results:
        md += [f"## Window {phases[0].duration_s:g} s, surge {phases[1].duration_s:g} s", ""]
        md += [md_table(ph["rows"], list(ph["rows"][0])), ""]
        md += [f"Adaptive layout changes (s, layout): {ph['timeline'].get('changes')}", ""]
    md += [progress.summary(), ""]
    return "\n".join(md)
