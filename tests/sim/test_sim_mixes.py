"""`nitsum sim mixes`: the separating mixes are what their construction says (from the cost model, on the committed
excerpt), a table where one level is best at both is reported and not run, and a quick run's summary is the
maximum over its static runs."""

from __future__ import annotations

from nitsum.policy.tiers import INTERACTIVE
from nitsum.sim.cluster import ClusterConfig
from nitsum.sim.experiments import mixes
from nitsum.workloads import default_trace_path, read_azure


def _code():
    return read_azure(default_trace_path("azure-code", prefer_excerpt=True))


def test_the_construction_separates_a_deep_and_a_wide_level():
    config, code = ClusterConfig(), _code()
    c = mixes.construct(config, code, 1.0)
    assert c.why_not == "" and (c.deep, c.wide) == (8, 4)  # TP2 prefills faster but cannot batch 70B requests
    assert c.capacity_per_s[2] > c.capacity_per_s[4] > c.capacity_per_s[8]
    assert c.capacity_per_s[c.deep] < c.batch_rate < c.capacity_per_s[c.wide]  # the batch window overloads TP8 only
    cost = config.cost_model()
    only_deep = [
        r
        for r in code
        if cost.prefill_time_ms(8, r.prompt_tokens, chunk_tokens=config.chunk_tokens)
        <= INTERACTIVE.ttft_ms
        < cost.prefill_time_ms(4, r.prompt_tokens, chunk_tokens=config.chunk_tokens)
    ]
    assert c.surge_prompts == len(only_deep) >= mixes.MIN_SURGE_PROMPTS
    phases = mixes.mixes(c, quick=False)
    assert [(p[0].duration_s, p[1].duration_s) for p in phases] == list(mixes.MIXES_S)
    assert all(p[0].interactive_fraction == 0.0 and p[1].interactive_fraction == 1.0 for p in phases)


def test_one_level_best_at_both_is_reported_not_run():
    c = mixes.construct(ClusterConfig(min_tp=4, max_tp=4), _code(), 1.0)
    assert c.deep == c.wide == 4 and "TP4 both" in c.why_not
    assert mixes.mixes(c, quick=True)  # the phases can be built; `run` runs none of them when why_not is set


def test_quick_run_reports_best_static_and_oracle_over_its_runs(tmp_path):
    result = mixes.run(tmp_path, quick=True)
    (row,) = result["rows"]
    runs = (tmp_path / "mixes_10s_5s.csv").read_text().splitlines()
    header = runs[0].split(",")
    wg = {line.split(",")[0]: float(line.split(",")[header.index("weighted_goodput_rps")]) for line in runs[1:]}
    assert row["best_static_wg"] == max(v for k, v in wg.items() if k.startswith("static:"))
    assert row["oracle_wg"] >= row["best_static_wg"] - 1e-9
    assert row["adaptive_wg"] == wg["adaptive"]
    assert (tmp_path / "mixes.md").is_file() and (tmp_path / "mixes.csv").is_file()
