"""The estimator models the scheduler the engine and the simulator run: prefill in one TTFT-deadline order
across tiers (engine/tiered.py), hybrid chunks priced as the simulator's steps, admission refusing what no
level can prefill in time, and the candidate set holding every static layout (issue 17)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from nitsum.policy.base import PolicyConfig
from nitsum.policy.costmodel import cost_model, model_spec
from nitsum.policy.estimate import (
    TierLoad,
    classes_of,
    edf_prefill,
    evaluate,
    hybrid_prefill_ms,
    quantize_tokens,
    summarize,
)
from nitsum.policy.snapshot import ArrivalStats, ClusterSnapshot, GroupView, NodeView, RequestView, group_id_of
from nitsum.policy.topology import AdaptivePolicy, faster_prefill_direction, static_candidates
from nitsum.topology import Topology

COST = cost_model("llama-3-70b", "h100")
CPU_TABLE = Path(__file__).resolve().parents[2] / "libs/nitsum/data/costmodel/cpu_tiny_steps.csv"


def tier(name: str, buckets, latency: bool) -> TierLoad:
    count = sum(c for _, c in buckets)
    return TierLoad(name, 10.0 if latency else 1.0, latency, 25.0, count, tuple(buckets), 1000, 100.0, 0, 1, 0.0)


def test_prefill_order_is_edf_across_tiers_not_tier_priority():
    # One request per 100 ms of pool time. Background requests whose deadline is nearer than the interactive
    # ones' are prefilled first (EDF), so they take the pool time the interactive ones needed.
    def pool(prompt: int):
        return 0.01, 100.0  # completions per ms, fastest prefill ms

    inter = tier("interactive", [(190.0, 1), (195.0, 1)], True)
    early_bg = tier("background", [(120.0, 1)], False)
    late_bg = tier("background", [(9000.0, 1)], False)
    assert edf_prefill((inter, late_bg), pool)["interactive"][0] == 1  # 2nd would finish at 200 > 195
    assert edf_prefill((inter, early_bg), pool)["interactive"][0] == 0  # the background one went first
    assert edf_prefill((inter, early_bg), pool)["background"][0] == 1
    # Tier order in the input does not matter: only the deadlines do.
    assert edf_prefill((early_bg, inter), pool) == edf_prefill((inter, early_bg), pool)


def test_hybrid_prefill_is_priced_as_the_simulators_step():
    # The prefilling sequence counts in the batch, and each chunk attends to about half the prompt so far
    # (1024 / 2 + 256 / 2 tokens, rounded up as memo keys are).
    priced = hybrid_prefill_ms(COST, 8, 1024, 256, 4, 4 * 1000)
    assert priced == 4 * COST.step_time_ms(8, 5, 4 + 256, 4 * 1000 + quantize_tokens(640))
    # Nothing to decode beside it: the group runs full 512-token chunks (as the simulator's does), not one step.
    one_step, chunked = COST.prefill_time_ms(8, 4096), COST.prefill_time_ms(8, 4096, chunk_tokens=512)
    assert one_step < chunked
    budget = (one_step + chunked) / 2.0  # the request would make it in one step, not in chunks
    req = RequestView("i0", "interactive", 200.0, 25.0, 10.0, 1000.0 - (200.0 - budget), 4096, 20)
    snap = ClusterSnapshot(1000.0, (node("[0-7 TP8 hybrid]"),), (req,))
    load = summarize(snap, snap.nodes[0], 1000.0)
    est = evaluate(COST, classes_of(Topology.parse("[0-7 TP8 hybrid]").groups), load, 5000.0, 512)
    assert est.latency_misses == 1


def node(top: str) -> NodeView:
    groups = tuple(
        GroupView(group_id_of("n0", g.start, g.tp), g.devices, g.tp, g.role) for g in Topology.parse(top).groups
    )
    return NodeView("n0", 8, 1, 8, groups, "h100")


def stream_score(top: str, arrivals, admit_levels=()):
    snap = ClusterSnapshot(0.0, (node(top),), (), arrivals=tuple(arrivals))
    load = summarize(snap, snap.nodes[0], 1000.0)
    return evaluate(COST, classes_of(Topology.parse(top).groups), load, 5000.0, 512, 0, admit_levels)


def test_a_prompt_no_level_prefills_in_time_is_refused_and_costs_no_prefill_time():
    # 12 k tokens take TP8 longer than 200 ms: admission refuses them at arrival, so they do not slow the
    # short prompts down; a quarter of the stream misses either way.
    short = ArrivalStats("interactive", 6.0, 200.0, 25.0, 10.0, (300, 300, 300, 300), 20.0)
    mixed = ArrivalStats("interactive", 8.0, 200.0, 25.0, 10.0, (300, 300, 300, 12_000), 20.0)
    alone, with_long = stream_score("[0-7 TP8 hybrid]", [short]), stream_score("[0-7 TP8 hybrid]", [mixed])
    assert abs(alone.score - with_long.score) < 1e-9
    assert with_long.misses >= 10  # 2 req/s x 5 s of refused long prompts


def test_overloaded_streams_share_the_pool_in_proportion_not_by_tier():
    # Far beyond what one TP8 group prefills: EDF with shedding serves each tier the same fraction 1 / rho, so
    # background arrivals take from the interactive stream (strict priority would leave it whole). The
    # background tier weighs 0 here, so each score is the interactive stream's worth alone.
    inter = ArrivalStats("interactive", 10.0, 200.0, 25.0, 10.0, (1500,) * 4, 20.0)
    bg = ArrivalStats("background", 40.0, 10_000.0, 100.0, 0.0, (1500,) * 4, 20.0)
    alone = stream_score("[0-7 TP8 hybrid]", [inter])
    beside = stream_score("[0-7 TP8 hybrid]", [inter, bg])
    assert alone.score > 0 and beside.score < 0.5 * alone.score
    # Below saturation the tighter target comes first: a light background stream takes nothing from it.
    light = ArrivalStats("background", 0.5, 10_000.0, 100.0, 0.0, (1500,) * 4, 20.0)
    assert abs(stream_score("[0-7 TP8 hybrid]", [inter, light]).score - alone.score) < 1e-9


def test_every_static_layout_is_a_candidate_tp1_prefill_splits_included():
    tops = {str(t) for t in static_candidates(8, (1, 2, 4, 8))}
    two_p_six_d = Topology.parse("[0 TP1 prefill][1 TP1 prefill]" + "".join(f"[{i} TP1 decode]" for i in range(2, 8)))
    assert str(two_p_six_d) in tops
    assert (
        "[0-1 TP2 prefill][2 TP1 decode][3 TP1 decode][4 TP1 decode][5 TP1 decode][6 TP1 decode][7 TP1 decode]" in tops
    )
    assert len(tops) == 31


def test_boot_layout_is_chosen_on_the_first_snapshot_with_measured_arrivals():
    # A background-only stream of the 8B model: the estimate prefers smaller groups to the boot TP8. At boot
    # (the node never changed) the policy moves at once, inside the settle time a later shift would need.
    pol = AdaptivePolicy(PolicyConfig(model=model_spec("llama-3-8b")))
    boot = node("[0-7 TP8 hybrid]")
    bg = ArrivalStats("background", 40.0, 10_000.0, 100.0, 1.0, (1000,) * 4, 100.0)
    reqs = tuple(RequestView(f"b{i}", "background", 10_000.0, 100.0, 1.0, 900.0, 1000, 100) for i in range(20))
    [d] = pol.decide_topology(ClusterSnapshot(1000.0, (boot,), reqs, arrivals=(bg,), load_shift_ms=0.0))
    assert d.target is not None and len(d.target.groups) > 1, d.reason
    # Without arrivals counted yet (the epoch at 0 s) there is nothing to choose from: keep.
    [d0] = pol.decide_topology(ClusterSnapshot(0.0, (boot,), reqs, arrivals=(), load_shift_ms=0.0))
    assert d0.target is None
    # After the boot change the settle rule holds as before.
    moved = NodeView("n0", 8, 1, 8, node(str(d.target)).groups, "h100", 1000.0)
    [d1] = pol.decide_topology(ClusterSnapshot(5000.0, (moved,), reqs, arrivals=(bg,), load_shift_ms=0.0))
    assert d1.target is None and "settles" in d1.reason


def test_a_change_made_before_a_rising_shift_is_revised_once_the_window_holds_the_new_load():
    # Rule 25: the node last changed (to TP8) at 1 s, for the load before the shift at 20 s. Once the shift is
    # 5 s old, it may change inside the 10 s settle time, once; not sooner, and not where the stream has stopped
    # (no stream left for a new layout to match).
    pol = AdaptivePolicy(PolicyConfig(model=model_spec("llama-3-8b")))
    tp8 = NodeView("n0", 8, 1, 8, node("[0-7 TP8 hybrid]").groups, "h100", 1000.0)
    bg = ArrivalStats("background", 40.0, 10_000.0, 100.0, 1.0, (1000,) * 4, 100.0)
    reqs = tuple(RequestView(f"b{i}", "background", 10_000.0, 100.0, 1.0, 24_900.0, 1000, 100) for i in range(20))

    def decide(now_ms, top=tp8, stopped=False):
        snap = ClusterSnapshot(now_ms, (top,), reqs, arrivals=(bg,), load_shift_ms=20_000.0, load_shift_stopped=stopped)
        return pol.decide_topology(snap)[0]

    assert decide(22_000.0).target is None  # 2 s after the shift
    revised = decide(25_000.0)
    assert revised.target is not None and len(revised.target.groups) > 1, revised.reason
    held = decide(25_000.0, stopped=True)
    assert held.target is None and "settles" in held.reason
    # After the revision the one-change-per-shift rule holds.
    moved = NodeView("n0", 8, 1, 8, node(str(revised.target)).groups, "h100", 25_000.0)
    again = decide(31_000.0, top=moved)  # past the settle time too
    assert again.target is None and "changed already" in again.reason


def test_a_surge_prefers_the_direction_in_which_its_prompts_prefill_sooner():
    from nitsum.sim.cluster import ClusterConfig

    # Data-sheet roofline: a higher TP prefills a 1,000-token prompt sooner (consolidate). The measured CPU
    # table: its TP8 steps are slower than TP1's (the ranks share two cores), so the surge goes down instead.
    snap = ClusterSnapshot(
        1000.0, (node("[0-7 TP8 hybrid]"),), (RequestView("i", "interactive", 200.0, 25.0, 10.0, 990.0, 1000, 20),)
    )
    load = summarize(snap, snap.nodes[0], 1000.0)
    assert faster_prefill_direction(COST, (4, 8), load) == 1
    measured = ClusterConfig(model="tiny", device_kind="cpu", device_table=CPU_TABLE).cost_model()
    assert measured.prefill_time_ms(8, 1024) > measured.prefill_time_ms(1, 1024)
    assert faster_prefill_direction(measured, (1, 2, 4, 8), load) == -1


def test_a_prefill_group_holds_a_short_prompt_back_by_half_a_step_of_what_waits_not_of_a_full_batch():
    pd = Topology.parse("[0-3 TP4 prefill][4-7 TP4 decode]")
    own = COST.prefill_time_ms(4, 512) + COST.step_time_ms(4, 1, 512, 512) / 2.0
    full_batch = COST.prefill_time_ms(4, 512) + COST.step_time_ms(4, 1, 8192, 8192) / 2.0
    budget = (own + full_batch) / 2.0  # in time behind its own half step, late behind half an 8,192-token one
    req = RequestView("i0", "interactive", 200.0, 25.0, 10.0, 1000.0 - (200.0 - budget), 512, 20)
    snap = ClusterSnapshot(1000.0, (node(str(pd)),), (req,))
    load = summarize(snap, snap.nodes[0], 1000.0)
    assert evaluate(COST, classes_of(pd.groups), load, 5000.0, 512, 8192).latency_misses == 0
    # A queue of 16 such prompts fills the batch: then the head-of-line wait is half a full step again.
    many = tuple(replace(req, request_id=f"i{k}") for k in range(16))
    snap = ClusterSnapshot(1000.0, (node(str(pd)),), many)
    load = summarize(snap, snap.nodes[0], 1000.0)
    assert evaluate(COST, classes_of(pd.groups), load, 5000.0, 512, 8192).latency_misses == 16


def test_quantized_token_counts_stay_put_when_quantized_again():
    """A context built from quantized counts is quantized again (decode contexts, stream contexts): rounding up by
    the logarithm alone took every grid value to the next eighth of an octave (1,092 -> 1,117 -> 1,218)."""
    from nitsum.policy.nodeload import quantize_tokens

    values = [*range(1, 5000), 1092, 65_537, 123_456.7]
    for n in values:
        q = quantize_tokens(n)
        assert q >= n and quantize_tokens(q) == q, (n, q)
    assert [quantize_tokens(n) for n in (1092, 1117)] == [1117, 1117]
    assert all(quantize_tokens(a) <= quantize_tokens(b) for a, b in zip(values[:4998], values[1:4999]))
